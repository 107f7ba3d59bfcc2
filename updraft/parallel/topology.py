"""Where a rank sits among the engine's ranks, and the groups it belongs to.

The world is ``tensor x prefill_context`` ranks, rank ``w`` at tensor rank ``w % T`` of
prefill-context rank ``w // T``:

* a **tensor** group is the T ranks of one prefill-context rank: they split every
  layer's heads and MLP rows;
* a **prefill-context** group is the P ranks of one tensor rank: they split a long
  prefill's tokens, and share its K/V layer by layer;
* a **decode-context** group is C consecutive ranks of one tensor group (C divides T):
  they hold the same KV heads, and each keeps every C-th position of the context.

Every group has a name, derived from the world group's, that names its process group
and shared-memory region (``parallel/collectives.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from updraft.config import ParallelSizes


@dataclass(frozen=True)
class GroupRank:
    """One rank's place in one process group."""

    rank: int
    size: int
    group: str  # the process group's name (parallel/collectives.py)


@dataclass(frozen=True)
class RankPlace:
    rank: int  # in the world group
    sizes: ParallelSizes
    name: str  # the world group's name; usable as a shared-memory region's name

    @property
    def world(self) -> GroupRank:
        return GroupRank(self.rank, self.sizes.world, self.name)

    @property
    def tensor_index(self) -> int:
        return self.rank % self.sizes.tensor

    @property
    def prefill_context_index(self) -> int:
        return self.rank // self.sizes.tensor

    @property
    def tensor(self) -> GroupRank:
        return GroupRank(
            self.tensor_index, self.sizes.tensor, f"{self.name}.tp{self.prefill_context_index}"
        )

    @property
    def prefill_context(self) -> GroupRank:
        return GroupRank(
            self.prefill_context_index,
            self.sizes.prefill_context,
            f"{self.name}.pcp{self.tensor_index}",
        )

    @property
    def decode_context(self) -> GroupRank:
        size = self.sizes.decode_context
        return GroupRank(
            self.tensor_index % size,
            size,
            f"{self.name}.dcp{self.prefill_context_index}.{self.tensor_index // size}",
        )

    @property
    def kv_heads(self) -> GroupRank:
        """This rank's share of the KV heads: split over the tensor ranks, except that
        the C ranks of a decode-context group keep the same ones."""
        size = self.sizes.decode_context
        return GroupRank(self.tensor_index // size, self.sizes.tensor // size, self.tensor.group)

    def subgroups(self) -> list[tuple[GroupRank, list[int]]]:
        """Each group of more than one rank this rank belongs to, with its members'
        world ranks in group-rank order."""
        tensor, first = self.sizes.tensor, self.prefill_context_index * self.sizes.tensor
        groups = [
            (self.tensor, [first + t for t in range(tensor)]),
            (
                self.prefill_context,
                [p * tensor + self.tensor_index for p in range(self.sizes.prefill_context)],
            ),
        ]
        dcp = self.decode_context
        base = first + self.tensor_index - dcp.rank
        groups.append((dcp, [base + c for c in range(dcp.size)]))
        return [(group, members) for group, members in groups if group.size > 1]


def rank_device(device: str, rank: int | None = None) -> str:
    """Where rank ``rank`` computes (a single process: ``None``): a bare ``cuda`` means
    one GPU per rank (rank r on GPU r mod this machine's count), as NCCL wants; anything
    else as given. A CUDA device this PyTorch cannot see is refused."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(
            f"device {device!r} was asked for, but this PyTorch ({torch.__version__}) "
            "sees no CUDA device; use --device cpu, or install a CUDA build (README)"
        )
    if device != "cuda" or rank is None:
        return device
    return f"cuda:{rank % torch.cuda.device_count()}"


def uses_nccl(device: str, ranks_per_machine: int) -> bool:
    """Whether the in-step groups run over NCCL: on CUDA, when each rank of a machine
    has a GPU of its own (ranks sharing one GPU exchange through host memory)."""
    return (
        device.startswith("cuda")
        and torch.cuda.is_available()
        and torch.cuda.device_count() >= ranks_per_machine
    )
