"""The message at hand (loop/message.pyx): pyzmq's frames, and sending them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import zmq

from ..protocol import Buffer, ProtocolError


def _send_all(sock: zmq.Socket, frames: list[Any]) -> int:
    """Send ``frames`` (after a routing id already sent); the bytes sent."""
    sock.send_multipart(frames, copy=False)
    return sum(len(frame) for frame in frames)


def _view(frame: zmq.Frame | Buffer) -> memoryview:
    """A frame's bytes (a zmq.Frame, or bytes kept), without copying them."""
    return frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame)


def _source_fd(frame: zmq.Frame) -> int:
    """The fd of the connection a message came on (ZMQ_SRCFD); -1 for inproc, which has
    none (where zmq_msg_get returns -1, pyzmq raises)."""
    try:
        return int(frame.get(zmq.SRCFD))
    except zmq.ZMQError:
        return -1


def _parses(check: Callable[[Buffer], object], frame: Buffer) -> bool:
    try:
        check(frame)
    except ProtocolError:
        return False
    return True


# -- the message at hand (loop/message.pyx): pyzmq's frames ------------------------------


def message_bytes(frames: list[zmq.Frame]) -> int:
    """Its size after the routing id, as the traffic counters count it."""
    return sum(len(frame) for frame in frames[1:])


def _buffers(frames: list[zmq.Frame]) -> list[memoryview]:
    """A message's frames after the routing id, for the specs to parse."""
    return [frame.buffer for frame in frames[1:]]
