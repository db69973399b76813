"""The header codec on msgpack: the reference twin of :mod:`coordkit._codec_c`.

Same functions, byte-identical results, :class:`ProtocolError` for the same
inputs. It reads metadata frames with ``msgpack.Unpacker`` and ``skip()``, so
the part of a SUBMIT it does not need (sampling_params, kv_meta) is checked
for structure only and never built into objects, just as the C twin does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack

from .protocol import Buffer, Header, ProtocolError

__all__ = [
    "MAX_NESTING",
    "read_header",
    "read_submit",
    "rewrite_submit",
    "read_reply",
    "read_header_int",
    "read_submit_batch",
    "read_reply_batch",
    "write_header",
    "write_header_int",
    "encode",
    "decode",
]

#: encode and decode refuse arrays nested deeper than this.
MAX_NESTING = 512

_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1
_UINT64_MAX = (1 << 64) - 1
_METADATA = "malformed metadata frame"
_REPLY = "malformed engine reply"

# pack_array_header runs in C without releasing the GIL: one shared Packer is safe.
_packer = msgpack.Packer()


def _as_bytes(frame: Buffer) -> bytes:
    return frame if type(frame) is bytes else memoryview(frame).tobytes()


def _int64_arg(value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"expected an int, got {type(value).__name__}")
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise OverflowError(f"{value} does not fit int64")
    return int(value)


def _unpack(what: str, read: Callable[[], Any], rid: int | None = None) -> Any:
    try:
        return read()
    except msgpack.OutOfData:
        raise ProtocolError(f"{what}: truncated", rid) from None
    except msgpack.FormatError:
        raise ProtocolError(f"{what}: reserved byte 0xc1", rid) from None
    except msgpack.StackError:
        raise ProtocolError(f"{what}: nested too deep", rid) from None
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"{what}: {str(exc) or type(exc).__name__}", rid) from None


def _int(what: str, value: Any, out_of_range: str = "int out of int64 range") -> int:
    if type(value) is not int:
        raise ProtocolError(f"{what}: unexpected type")
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise ProtocolError(f"{what}: {out_of_range}")
    return value


def _start(frame: bytes, min_length: int) -> tuple[msgpack.Unpacker, int, int]:
    """An unpacker just past the header int, the array length and the header."""
    if not frame:
        raise ProtocolError(f"{_METADATA}: truncated")
    # sized to the frame: the default would allocate 1 MiB per call
    unpacker = msgpack.Unpacker(raw=True, strict_map_key=False, max_buffer_size=len(frame))
    unpacker.feed(frame)
    length = _unpack(_METADATA, unpacker.read_array_header)
    if length < min_length:
        raise ProtocolError(f"{_METADATA}: array of the wrong length")
    header = _int(_METADATA, _unpack(_METADATA, unpacker.unpack))
    return unpacker, length, header


def read_header(frame: Buffer) -> tuple[int, int, int]:
    """``(header, length, end)`` of a metadata frame ``[header, ...]``.

    ``end`` is the offset just after the header int; nothing after it is read.
    """
    unpacker, length, header = _start(_as_bytes(frame), 1)
    return header, length, unpacker.tell()


def read_submit(frame: Buffer) -> tuple[int, int, int, int]:
    """``(header, length, rid, offset)`` of ``[header, rid, *rest]``, validated whole.

    ``rest`` may hold any msgpack objects; ``offset`` is where they start.
    A fault after the rid raises ProtocolError with ``rid`` set.
    """
    data = _as_bytes(frame)
    unpacker, length, header = _start(data, 2)
    rid = _int(_METADATA, _unpack(_METADATA, unpacker.unpack), "request id out of range")
    offset = unpacker.tell()
    for _ in range(length - 2):
        _unpack(_METADATA, unpacker.skip, rid)
    if unpacker.tell() != len(data):
        raise ProtocolError(f"{_METADATA}: trailing bytes", rid)
    return header, length, rid, offset


def rewrite_submit(frame: Buffer, rid: int) -> bytes:
    """``frame``, validated as by read_submit, with its request id replaced by ``rid``."""
    rid = _int64_arg(rid)
    data = _as_bytes(frame)
    header, length, _, offset = read_submit(data)
    prefix = _packer.pack_array_header(length) + _packer.pack(header) + _packer.pack(rid)
    return prefix + data[offset:]


def read_reply(frame: Buffer) -> tuple[int, list[tuple[int, bool]]]:
    """``(header, [(rid, needs_detokenize), ...])`` of an engine's batch.

    ``[21, [[rid, needs_detokenize], ...]]`` or ``[22, [rid, ...]]``, whose
    entries come back as ``(rid, False)``.
    """
    data = _as_bytes(frame)
    metadata = _unpack(_REPLY, lambda: msgpack.unpackb(data, raw=True, strict_map_key=False))
    if type(metadata) is not list or len(metadata) != 2:
        raise ProtocolError(f"{_REPLY}: not an array of two")
    header, batch = metadata
    if _int(_REPLY, header) not in (Header.ENGINE_REPLY, Header.ENGINE_REPLY_PARTIAL):
        raise ProtocolError(f"{_REPLY}: not an engine reply header")
    if type(batch) is not list:
        raise ProtocolError(f"{_REPLY}: the batch is not an array")
    if header == Header.ENGINE_REPLY_PARTIAL:
        return header, [(_int(_REPLY, rid, "request id out of range"), False) for rid in batch]
    entries = []
    for entry in batch:
        if type(entry) is not list or len(entry) != 2 or type(entry[1]) is not bool:
            raise ProtocolError(f"{_REPLY}: an entry is not [rid, needs_detokenize]")
        entries.append((_int(_REPLY, entry[0], "request id out of range"), entry[1]))
    return header, entries


def read_header_int(frame: Buffer) -> tuple[int, int]:
    """``(header, value)`` of ``[header, value]``, two int64s, validated whole."""
    data = _as_bytes(frame)
    unpacker, length, header = _start(data, 2)
    if length != 2:
        raise ProtocolError(f"{_METADATA}: array of the wrong length")
    value = _int(_METADATA, _unpack(_METADATA, unpacker.unpack))
    if unpacker.tell() != len(data):
        raise ProtocolError(f"{_METADATA}: trailing bytes")
    return header, value


def _batch(what: str, data: bytes, header: int) -> tuple[msgpack.Unpacker, int]:
    """An unpacker at the first entry of ``[header, [entry, ...]]``, and the entry count."""
    if not data:
        raise ProtocolError(f"{what}: truncated")
    unpacker = msgpack.Unpacker(raw=True, strict_map_key=False, max_buffer_size=len(data))
    unpacker.feed(data)
    if _unpack(what, unpacker.read_array_header) != 2:
        raise ProtocolError(f"{what}: array of the wrong length")
    if _int(what, _unpack(what, unpacker.unpack)) != header:
        raise ProtocolError(f"{what}: unexpected header")
    return unpacker, _unpack(what, unpacker.read_array_header)


def _bool(what: str, value: Any) -> bool:
    if type(value) is not bool:
        raise ProtocolError(f"{what}: unexpected type")
    return value


def read_submit_batch(frame: Buffer, width: int = 3) -> list[tuple[int, int, int, bool]]:
    """``[(rid, params_offset, params_size, hashed), ...]`` of a SUBMIT_BATCH.

    ``width`` 3: a client's ``[95, [[rid, params, hashed], ...]]``; 2: the
    coordinator's to an engine, ``[95, [[rid, params], ...]]`` (hashed False).
    Each entry's sampling params are ``frame[offset : offset + size]``, verbatim.
    """
    if width not in (2, 3):
        raise ValueError(f"width must be 2 or 3, not {width!r}")
    what = "malformed SUBMIT_BATCH"
    data = _as_bytes(frame)
    unpacker, count = _batch(what, data, Header.SUBMIT_BATCH)
    entries = []
    for _ in range(count):
        if _unpack(what, unpacker.read_array_header) != width:
            raise ProtocolError(f"{what}: array of the wrong length")
        rid = _int(what, _unpack(what, unpacker.unpack), "request id out of range")
        offset = unpacker.tell()
        _unpack(what, unpacker.skip)
        size = unpacker.tell() - offset
        hashed = _bool(what, _unpack(what, unpacker.unpack)) if width == 3 else False
        entries.append((rid, offset, size, hashed))
    if unpacker.tell() != len(data):
        raise ProtocolError(f"{what}: trailing bytes")
    return entries


def read_reply_batch(frame: Buffer) -> list[tuple[int, bool]]:
    """``[(rid, final), ...]`` of a REPLY_BATCH ``[96, [[rid, final], ...]]``."""
    what = "malformed REPLY_BATCH"
    data = _as_bytes(frame)
    unpacker, count = _batch(what, data, Header.REPLY_BATCH)
    entries = []
    for _ in range(count):
        if _unpack(what, unpacker.read_array_header) != 2:
            raise ProtocolError(f"{what}: array of the wrong length")
        rid = _int(what, _unpack(what, unpacker.unpack), "request id out of range")
        entries.append((rid, _bool(what, _unpack(what, unpacker.unpack))))
    if unpacker.tell() != len(data):
        raise ProtocolError(f"{what}: trailing bytes")
    return entries


def write_header(header: int) -> bytes:
    """``msgpack.packb([header])``."""
    return msgpack.packb([_int64_arg(header)])


def write_header_int(header: int, value: int) -> bytes:
    """``msgpack.packb([header, value])``."""
    return msgpack.packb([_int64_arg(header), _int64_arg(value)])


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
