"""The message rank 0 broadcasts once the topology is known: the launch's answer.

One fixed-size byte buffer, so that no rank needs a size first (one collective,
O(1) bytes): a status byte, the release mode, the length of a part carried for
others and that part (the fault settings every rank adopts from rank 0,
mpi4jax_dist/faults/settings.py: carried here, never read), then UTF-8 text (the
coordinator's ``host:port``, or rank 0's error).
"""

from __future__ import annotations

import typing

import numpy as np

# Big enough for "[IPv6]:port" and for an error message.
MESSAGE_BYTES = 1024
OK, ERROR, BAD_SETTING = 1, 2, 3
# How the other ranks learn that rank 0's service listens; rank 0 decides (from its
# MPI thread level) and the mode travels with the address, so every rank agrees.
RELEASE_MODES = ("thread", "probe")
_CARRIED_AT = 3


class Message(typing.NamedTuple):
    """What rank 0 says to every rank.

    Attributes:
        status: :data:`OK`, :data:`ERROR` or :data:`BAD_SETTING` (text: the error).
        mode: one of :data:`RELEASE_MODES`.
        text: the coordinator's address, or the error.
        carried: the bytes carried for the fault settings.
    """

    status: int
    mode: str
    text: str
    carried: bytes


def buffer() -> np.ndarray:
    """Return the zeroed buffer every rank passes to the broadcast."""
    return np.zeros(MESSAGE_BYTES, dtype=np.uint8)


def encode(out: np.ndarray, message: Message) -> None:
    """Write ``message`` into ``out`` (:func:`buffer`); text past the end is cut."""
    text_at = _CARRIED_AT + len(message.carried)
    data = message.text.encode()[: out.size - text_at]
    out[0] = message.status
    out[1] = RELEASE_MODES.index(message.mode)
    out[2] = len(message.carried)
    out[_CARRIED_AT:text_at] = np.frombuffer(message.carried, dtype=np.uint8)
    out[text_at : text_at + len(data)] = np.frombuffer(data, dtype=np.uint8)


def decode(received: np.ndarray) -> Message:
    """Return the :class:`Message` that :func:`encode` wrote."""
    text_at = _CARRIED_AT + int(received[2])
    return Message(
        status=int(received[0]),
        mode=RELEASE_MODES[int(received[1])],
        text=bytes(received[text_at:]).rstrip(b"\0").decode(errors="replace"),
        carried=bytes(received[_CARRIED_AT:text_at]),
    )
