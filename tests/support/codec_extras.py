"""The header codec's test-only functions, in Python: the twins of _codec_extras_c.pyx.

No product code calls them, so they live here rather than in the codecs:
``encode`` and ``decode`` (None, bool, int and arrays of them), ``rewrite_submit``
(read_submit, then write_submit with another rid), ``write_header`` (``[h]``)
and ``blake2b`` (hashlib's, the oracle of the C twin's own). They are built on
the Python codec's reads and writes, as the C twins are on the C codec's.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgpack

from coordkit._codec_py import _INT64_MIN, _as_bytes, _int64_arg, _unpack, read_submit, write_submit
from coordkit.protocol import Buffer, ProtocolError

__all__ = ["MAX_NESTING", "encode", "decode", "rewrite_submit", "write_header", "blake2b"]

#: encode and decode refuse arrays nested deeper than this.
MAX_NESTING = 512

_UINT64_MAX = (1 << 64) - 1


def _check_supported(what: str, obj: Any) -> None:
    """ProtocolError unless obj is None, bool, int or arrays of them, not too deep."""
    stack = [(obj, 0)]
    while stack:
        item, level = stack.pop()
        if item is None or isinstance(item, bool):
            continue
        if isinstance(item, int):
            if not _INT64_MIN <= item <= _UINT64_MAX:
                raise ProtocolError(f"{what}: {item} is out of range")
        elif isinstance(item, (list, tuple)):
            if level >= MAX_NESTING:
                raise ProtocolError(f"{what}: nested too deep")
            stack.extend((child, level + 1) for child in item)
        else:
            raise ProtocolError(f"{what}: unsupported type {type(item).__name__}")


def encode(obj: Any) -> bytes:
    """``msgpack.packb(obj)`` for None, bool, int (-2**63 .. 2**64-1) and lists
    or tuples of them, nested at most MAX_NESTING deep; ProtocolError otherwise."""
    _check_supported("encode", obj)
    return msgpack.packb(obj)


def decode(frame: Buffer) -> Any:
    """``msgpack.unpackb(frame)`` for the types encode writes; ProtocolError for
    anything else, for trailing bytes and for arrays nested deeper than MAX_NESTING."""
    data = _as_bytes(frame)
    obj = _unpack("decode", lambda: msgpack.unpackb(data))
    _check_supported("decode", obj)
    return obj


def rewrite_submit(frame: Buffer, rid: int) -> bytes:
    """``frame``, validated as by read_submit, with its request id replaced by ``rid``."""
    header, length, _, offset = read_submit(frame)
    return write_submit(header, length, rid, memoryview(frame)[offset:])


def write_header(header: int) -> bytes:
    """``msgpack.packb([header])``."""
    return msgpack.packb([_int64_arg(header)])


def blake2b(data: Buffer, digest_size: int = 8) -> bytes:
    """``hashlib.blake2b(data, digest_size=digest_size).digest()``: the oracle the C
    twin's BLAKE2b (``includes/blake2b.h``) is tested against."""
    if not 1 <= digest_size <= 64:
        raise ValueError("digest_size must be in 1..64")
    return hashlib.blake2b(data, digest_size=digest_size).digest()
