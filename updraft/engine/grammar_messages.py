"""What the engine and its grammar process say to each other over their socket: each
message a pickled tuple behind its length (both ends are this package, in processes one
user started: no one else writes to the socket).

Engine to grammar process, in order:
* ``("compile", handle, (kind, text))``: a matcher for the spec with that key;
* ``("accept", [(handle, tokens), ...])``: tokens the requests appended;
* ``("mask", job, handle, drafts)``: the masks at a matcher's state and after each draft;
* ``("remove", handle)``: the request has ended.

Back: ``("compiled", handle, error or None)``, ``("verdict", handle, verdict, message)``
for a matcher that an accept completed or broke, ``("slow", job)`` for a mask that goes on
at a lower priority (its grammar's masks have cost ``QUICK_MASK_SECONDS`` of CPU: a step
need not wait for it), and ``("mask", job, MaskReply)``.
"""

from __future__ import annotations

import pickle
import socket
import struct
from dataclasses import dataclass

COMPLETE = "complete"  # the grammar takes nothing more: the output is done
BROKEN = "broken"  # a token the grammar forbids was appended
LENGTH = struct.Struct("<Q")


@dataclass
class MaskReply:
    """One mask job's outcome: the rows' bits (``words`` little-endian int32 a row), or
    the matcher's verdict instead, or why there is neither."""

    bitmask: bytes | None = None
    # After how many of the job's drafts the grammar is complete, when it is within them.
    stops_after: int | None = None
    verdict: str | None = None
    error: str | None = None
    seconds: float = 0.0  # CPU time


def frame(message: tuple) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return LENGTH.pack(len(data)) + data


def write_message(connection: socket.socket, message: tuple) -> None:
    connection.sendall(frame(message))


def read_message(connection: socket.socket) -> tuple | None:
    """The next message, or None once the other end has closed."""
    head = _read_exactly(connection, LENGTH.size)
    if head is None:
        return None
    body = _read_exactly(connection, LENGTH.unpack(head)[0])
    return None if body is None else pickle.loads(body)


def _read_exactly(connection: socket.socket, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        try:
            chunk = connection.recv(min(left, 1 << 20))
        except ConnectionError:
            return None
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class MessageBuffer:
    """Messages cut out of bytes read without blocking (the engine's side)."""

    def __init__(self) -> None:
        self._data = bytearray()

    def feed(self, data: bytes) -> list[tuple]:
        self._data += data
        messages = []
        while len(self._data) >= LENGTH.size:
            size = LENGTH.unpack_from(self._data)[0]
            end = LENGTH.size + size
            if len(self._data) < end:
                break
            messages.append(pickle.loads(bytes(self._data[LENGTH.size : end])))
            del self._data[:end]
        return messages
