"""Where a running engine's resident memory goes (``updraft doctor --memory``).

The resident set is read once (``/proc/self/smaps``) and cut into parts that add up to
it: the weights' file pages (the checkpoint's own mapping) and their copies in memory
(oneDNN's packed ones, whose address is hidden, at their size), the KV cache, the
captured graphs' memory, compiled code, torch's compiler stack, the interpreter and
torch as measured when they were imported, the imports after them, the pages malloc
held free (given back to measure them: read last), and "other", what is left. The
engine's own objects say which addresses are whose (a weight tensor, a KV cache, a
graph's arena); ``mincore`` says which of their pages are resident, and a page counts
once, for the first part that claims it. The peak is cut by the phase of start-up it
came in: RSS at the phase's start plus what the phase added on top.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from updraft.checkpoints.gguf import linked_files

if TYPE_CHECKING:
    from updraft.runner.runner import Runner
from updraft.resident import (
    MIB,
    PAGE,
    ImportBaseline,
    Mapping,
    Phase,
    give_back_free_memory,
    import_cost,
    mappings,
    resident_pages,
    status_bytes,
)

# What compiling captured runs imports, the last the one a compile surely loaded.
COMPILER_STACK = ("torch._dynamo", "torch._inductor.compile_fx")


@dataclass
class MemoryReport:
    """Resident bytes by part (they add up to ``rss``), the peak, and the figures the
    parts are read against."""

    rss: int
    peak: int
    parts: dict[str, int]
    kv_allocated: int = 0
    kv_in_use: int = 0  # the bytes of the blocks requests hold now
    weight_file_bytes: int = 0
    phases: list[Phase] = field(default_factory=list)
    phase_start: int = 0  # RSS when the first phase began

    def peak_split(self) -> tuple[str, int, int] | None:
        """(phase, RSS at its start, what it added above that) of the phase that
        reached the peak, if phases were recorded."""
        if not self.phases:
            return None
        starts = [self.phase_start] + [phase.rss for phase in self.phases[:-1]]
        index = max(range(len(self.phases)), key=lambda i: self.phases[i].peak)
        phase = self.phases[index]
        return phase.name, starts[index], phase.peak - starts[index]

    def lines(self) -> list[str]:
        """The report as text, MiB."""
        out = [f"resident now: {self.rss / MIB:.0f} MiB; peak: {self.peak / MIB:.0f} MiB"]
        for name, size in self.parts.items():
            out.append(f"  {name:<34} {size / MIB:8.1f} MiB")
        out.append(
            f"  (KV: {self.kv_in_use / MIB:.1f} MiB in blocks in use, "
            f"{self.kv_allocated / MIB:.0f} MiB allocated; weight files: "
            f"{self.weight_file_bytes / MIB:.1f} MiB)"
        )
        split = self.peak_split()
        if split is not None:
            start = self.phase_start
            out.append("start-up, by phase (RSS at its end, its peak):")
            for phase in self.phases:
                out.append(
                    f"  {phase.name:<34} {phase.rss / MIB:8.1f} {phase.peak / MIB:8.1f} MiB"
                    f"  (+{(phase.peak - start) / MIB:.1f} above its start)"
                )
                start = phase.rss
            name, before, added = split
            out.append(
                f"the peak came in {name!r}: {before / MIB:.0f} MiB at its start + "
                f"{added / MIB:.0f} MiB it added"
            )
        return out


@dataclass
class EngineMemory:
    """What a runner owns, as tensors: its model's weights, its KV caches, its captured
    graphs' memory; and the files its weights came from."""

    weights: list[torch.Tensor]
    kv_caches: list[torch.Tensor]
    graphs: list[torch.Tensor]
    weight_files: list[Path]
    kv_in_use: int


def build_report(
    owned: EngineMemory,
    baseline: ImportBaseline | None,
    phases: Iterable[Phase] = (),
    phase_start: int = 0,
    compiler_stack: int = 0,
) -> MemoryReport:
    """Cut the resident set now into its parts (see the module's note);
    ``compiler_stack``: what importing it cost, if it was (``compiler_stack_cost``)."""
    maps = mappings()
    rss = sum(m.rss for m in maps)
    files = {str(path.resolve()) for path in owned.weight_files}
    parts: dict[str, int] = {}
    parts["weights: the file's mapped pages"] = sum(m.rss for m in maps if m.path in files)
    claimed = np.zeros(0, dtype=np.int64)
    anonymous = [(m.start, m.end) for m in maps if not m.file_backed]
    for name, tensors in (
        ("weights: copies in memory", owned.weights),
        ("KV cache", owned.kv_caches),
        ("captured graphs (arenas, inputs, outputs)", owned.graphs),
    ):
        pages = np.setdiff1d(resident_pages(_within(_ranges(tensors), anonymous)), claimed)
        parts[name] = len(pages) * PAGE
        claimed = np.union1d(claimed, pages)
    # oneDNN's packed weights hide their address: counted at their size, all written
    parts["weights: oneDNN's packed copies"] = sum(
        t.numel() * t.element_size() for t in owned.weights if _opaque(t)
    )
    parts["compiled code (kernels, inductor's runs)"] = sum(
        m.rss for m in maps if m.file_backed and _compiled(m)
    )
    parts["torch's compiler stack (import)"] = compiler_stack
    if baseline is not None:
        parts["interpreter"] = baseline.interpreter
        parts["torch import"] = baseline.torch_import - baseline.interpreter
        if phase_start:
            parts["imports before the engine (updraft, ...)"] = phase_start - baseline.torch_import
    parts["other"] = rss - sum(parts.values())
    # Read last, since measuring it gives it back: the resident bytes malloc held free.
    slack = give_back_free_memory()
    parts["allocator slack (malloc's free pages)"] = slack
    parts["other"] -= slack
    return MemoryReport(
        rss=rss,
        # The engine's peak, to the last phase marked: not what this report's own walk
        # over every tensor and mapping adds after it (30-60 MiB on a 500M model).
        peak=max(phase.peak for phase in phases) if phases else status_bytes("VmHWM"),
        parts=parts,
        kv_allocated=sum(t.untyped_storage().nbytes() for t in _distinct(owned.kv_caches)),
        kv_in_use=owned.kv_in_use,
        weight_file_bytes=sum(path.stat().st_size for path in owned.weight_files),
        phases=list(phases),
        phase_start=phase_start,
    )


def compiler_stack_cost() -> int:
    """What importing torch's compiler stack (dynamo, inductor, sympy) costs, if capture
    and compiling loaded it here: measured in a child process (0 if not loaded)."""
    return import_cost(COMPILER_STACK) if COMPILER_STACK[-1] in sys.modules else 0


def runner_memory(runner: Runner, kv_blocks_used: int, model_dir: str) -> EngineMemory:
    """A runner's tensors by part (``kv_blocks_used``: the blocks requests hold now;
    their bytes counted as a block's share of every cache tensor, which a hybrid
    model's state slots make approximate)."""
    model = runner.model
    weights = [*model.parameters(), *model.buffers()]
    graphs = [] if runner.captured is None else runner.captured.held_tensors()
    kv = _distinct(runner.kv_caches)
    per_block = sum(
        t.untyped_storage().nbytes() // max(1, runner.num_blocks + 1) for t in kv
    )  # each cache holds the pool's blocks and one spare
    return EngineMemory(
        weights=weights,
        kv_caches=kv,
        graphs=graphs,
        weight_files=weight_files(model_dir),
        kv_in_use=per_block * kv_blocks_used,
    )


def weight_files(model_dir: str) -> list[Path]:
    """The files a checkpoint's weights are read from: its GGUF file(s), else its
    safetensors files."""
    linked = linked_files(Path(model_dir))
    if linked is not None:
        return linked
    return sorted(Path(model_dir).glob("*.safetensors"))


def _opaque(tensor: torch.Tensor) -> bool:
    """A tensor whose storage cannot be seen (oneDNN's packed layout)."""
    return tensor.is_mkldnn or tensor.layout != torch.strided


def _distinct(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for tensor in tensors:
        if _opaque(tensor):
            continue
        seen.setdefault(tensor.untyped_storage().data_ptr(), tensor)
    return list(seen.values())


def _ranges(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    out = []
    for tensor in tensors:
        if tensor.device.type != "cpu" or tensor.is_meta or _opaque(tensor):
            continue
        storage = tensor.untyped_storage()
        if storage.nbytes():
            out.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    return out


def _within(ranges: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``ranges`` inside ``spans`` (anonymous mappings: a tensor over a
    file's map is that file's pages, counted with it)."""
    out = []
    for start, end in ranges:
        for low, high in spans:
            if low < end and start < high:
                out.append((max(start, low), min(end, high)))
    return out


def _compiled(mapping: Mapping) -> bool:
    """A shared library built on this machine (the C kernels, inductor's runs): one
    outside the interpreter's, its packages' and the system's folders."""
    installed = (sys.prefix, sys.base_prefix, "/usr/", "/lib")
    return ".so" in Path(mapping.path).name and not mapping.path.startswith(installed)
