"""Where the engine core and its API processes meet: ZeroMQ endpoints, as sockets in a
directory only this user can open (the core binds them, serve/engine_core.py; each API
process connects, serve/engine_client.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CoreAddresses:
    """ZeroMQ endpoints: the core's input, and one output per API process, as sockets
    in ``directory``."""

    directory: str
    input: str
    outputs: tuple[str, ...]

    @classmethod
    def in_directory(cls, directory: str, num_clients: int) -> CoreAddresses:
        return cls(
            directory,
            f"ipc://{directory}/engine-input",
            tuple(f"ipc://{directory}/engine-output-{i}" for i in range(num_clients)),
        )
