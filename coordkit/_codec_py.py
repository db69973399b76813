"""The header codec on msgpack: the reference twin of :mod:`coordkit._codec_c`.

Same functions, byte-identical results, :class:`ProtocolError` for the same
inputs. It reads metadata frames with ``msgpack.Unpacker`` and ``skip()``, so
the part of a SUBMIT it does not need (sampling_params, kv_meta) is checked
for structure only and never built into objects, just as the C twin does.
Megatron-Core's single frames are read the same way: a prompt or a reply map
is skipped, never decoded, and handed back as a byte span.

The parts come in the order of the C twin's (``codec/*.pyx``), under the same
names: the reader (the reads every part is made of, the errors' texts), the
multipart frames, the single frames, the writer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import msgpack

from ._kvevents import Chains as KVChains
from ._kvevents import decode_batch as decode_kv_batch
from .protocol import PRIORITY_MAX, PRIORITY_MIN, Buffer, Frame, Header, ProtocolError, block_hashes

__all__ = [
    # multipart
    "read_header",
    "read_submit",
    "read_qos",
    "read_reply",
    "prompt_tokens",
    "read_header_int",
    "read_rids",
    "read_submit_batch",
    "read_reply_batch",
    "read_handoff",
    # single frame
    "read_single_head",
    "read_single_submit",
    "read_single_reply",
    "check_prompt",
    "check_map",
    "prompt_hashes",
    "streamed_tokens",
    "NO_TOKENS",
    "NEW_TOKENS",
    "ALL_TOKENS",
    # writer
    "write_submit",
    "write_header_int",
    "write_single_submit",
    # the engines' KV events
    "decode_kv_batch",
    "KVChains",
]

_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1
_UINT32_MAX = (1 << 32) - 1
_METADATA = "malformed metadata frame"
_REPLY = "malformed engine reply"

# The texts of the C twin's ck_strstatus, for the same faults.
_TRUNCATED = "truncated"
_BAD_TYPE = "unexpected type"
_NOT_MAP = "reply entry is not a map"
_NO_REQUEST_ID = "reply entry has no request_id"
_BAD_REQUEST_ID = "request_id is not an int64"
_PROMPT_STR = "the prompt is a str"
_BAD_TOKEN = "a token is not an int in [0, 2**32)"
_QOS_RANGE = "priority or deadline out of range"

#: The width of read_submit_batch that reads a client granted QoS (codec's CK_QOS_WIDTH).
QOS_WIDTH = 5

# "request_id" as a msgpack str, in each of its four forms.
# -- reader: the reads every part is made of ------------------------------------------


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


def _bool(what: str, value: Any) -> bool:
    if type(value) is not bool:
        raise ProtocolError(f"{what}: unexpected type")
    return value


def _unpacker(data: bytes) -> msgpack.Unpacker:
    # sized to the frame: the default would allocate 1 MiB per call
    unpacker = msgpack.Unpacker(raw=True, strict_map_key=False, max_buffer_size=max(len(data), 1))
    unpacker.feed(data)
    return unpacker


def _is_str(b: int) -> bool:
    return b & 0xE0 == 0xA0 or b in (0xD9, 0xDA, 0xDB)


def _is_array(b: int) -> bool:
    return b & 0xF0 == 0x90 or b in (0xDC, 0xDD)


def _is_map(b: int) -> bool:
    return b & 0xF0 == 0x80 or b in (0xDE, 0xDF)


def _is_int(b: int) -> bool:
    return b < 0x80 or b >= 0xE0 or 0xCC <= b <= 0xD3


def _is_prompt(b: int) -> bool:
    return _is_str(b) or _is_array(b)


def _array_length(what: str, data: bytes, unpacker: msgpack.Unpacker) -> int:
    at = unpacker.tell()
    if at < len(data) and not _is_array(data[at]):
        raise ProtocolError(f"{what}: {_BAD_TYPE}")
    return int(_unpack(what, unpacker.read_array_header))


def _count(what: str, data: bytes, unpacker: msgpack.Unpacker, kind: Callable[[int], bool]) -> int:
    """The element count of the array (or map: twice its pairs) that ``kind``
    says comes next, refused as truncated when its elements, a byte each at
    least, cannot fit in what is left: the checks of the C twin, in its order."""
    at = unpacker.tell()
    if at >= len(data):
        raise ProtocolError(f"{what}: {_TRUNCATED}")
    if not kind(data[at]):
        raise ProtocolError(f"{what}: {_BAD_TYPE}")
    if kind is _is_map:
        count = 2 * _unpack(what, unpacker.read_map_header)
    else:
        count = _unpack(what, unpacker.read_array_header)
    if count > len(data) - unpacker.tell():
        raise ProtocolError(f"{what}: {_TRUNCATED}")
    return count


def _skip_one(
    what: str, data: bytes, unpacker: msgpack.Unpacker, kind: Callable[[int], bool], rid: Any
) -> None:
    """Skip one object whose first byte ``kind`` accepts."""
    at = unpacker.tell()
    if at >= len(data):
        raise ProtocolError(f"{what}: {_TRUNCATED}", rid)
    if not kind(data[at]):
        raise ProtocolError(f"{what}: {_BAD_TYPE}", rid)
    _unpack(what, unpacker.skip, rid)


# -- multipart: the metadata frames of the multipart protocol --------------------------


def _start(
    frame: bytes, min_length: int, what: str = _METADATA
) -> tuple[msgpack.Unpacker, int, int]:
    """An unpacker just past the header int, the array length and the header."""
    if not frame:
        raise ProtocolError(f"{what}: truncated")
    # sized to the frame: the default would allocate 1 MiB per call
    unpacker = msgpack.Unpacker(raw=True, strict_map_key=False, max_buffer_size=len(frame))
    unpacker.feed(frame)
    length = _unpack(what, unpacker.read_array_header)
    if length < min_length:
        raise ProtocolError(f"{what}: array of the wrong length")
    header = _int(what, _unpack(what, unpacker.unpack))
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


def _qos(what: str, unpacker: msgpack.Unpacker) -> tuple[int, int]:
    """``priority, deadline_ms``: two ints, the priority in its range, the deadline >= 0."""
    values = []
    for _ in range(2):
        value = _unpack(what, unpacker.unpack)
        if type(value) is not int:
            raise ProtocolError(f"{what}: {_BAD_TYPE}")
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise ProtocolError(f"{what}: {_QOS_RANGE}")
        values.append(value)
    priority, deadline_ms = values
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX or deadline_ms < 0:
        raise ProtocolError(f"{what}: {_QOS_RANGE}")
    return priority, deadline_ms


def read_qos(frame: Buffer, offset: int) -> tuple[int, int, int]:
    """``(priority, deadline_ms, end)`` of the QoS fields at ``offset`` of a SUBMIT read
    whole by read_submit (``offset`` its rest's start); ``frame[end:]`` is its params.
    ProtocolError unless they are two ints, the priority in [PRIORITY_MIN,
    PRIORITY_MAX], the deadline >= 0."""
    data = _as_bytes(frame)
    if not 0 <= offset <= len(data):
        raise ValueError(f"offset {offset} is outside the frame")
    unpacker = _unpacker(data[offset:])
    priority, deadline_ms = _qos(_METADATA, unpacker)
    return priority, deadline_ms, offset + unpacker.tell()


def read_reply(frame: Buffer) -> tuple[int, list[tuple[int, bool] | None]]:
    """``(header, entries)`` of an engine's batch, one entry per body frame.

    ``[21, [[rid, needs_detokenize], ...]]`` or ``[22, [rid, ...]]``, whose
    entries come back as ``(rid, False)``. An entry that is well-formed
    msgpack but not of that shape (or whose rid does not fit int64) comes
    back as ``None``; ProtocolError only when the batch itself cannot be read.
    """
    data = _as_bytes(frame)
    unpacker, length, header = _start(data, 2, _REPLY)
    if length != 2:
        raise ProtocolError(f"{_REPLY}: array of the wrong length")
    if header not in (Header.ENGINE_REPLY, Header.ENGINE_REPLY_PARTIAL):
        raise ProtocolError(f"{_REPLY}: not an engine reply header")
    count = _unpack(_REPLY, unpacker.read_array_header)
    if count > len(data) - unpacker.tell():
        raise ProtocolError(f"{_REPLY}: truncated")
    entries = []
    for _ in range(count):
        start = unpacker.tell()
        _unpack(_REPLY, unpacker.skip)
        entries.append(_entry(data[start : unpacker.tell()], header == Header.ENGINE_REPLY))
    if unpacker.tell() != len(data):
        raise ProtocolError(f"{_REPLY}: trailing bytes")
    return header, entries


def _entry(data: bytes, full: bool) -> tuple[int, bool] | None:
    """One skipped entry of a batch, if it is ``[rid, flag]`` (full) or ``rid``."""
    try:
        entry = msgpack.unpackb(data, raw=True, strict_map_key=False)
    except Exception:  # well-formed, but not something an entry can be
        return None
    if full:
        if type(entry) is not list or len(entry) != 2 or type(entry[1]) is not bool:
            return None
        rid, flag = entry
    else:
        rid, flag = entry, False
    if type(rid) is not int or not _INT64_MIN <= rid <= _INT64_MAX:
        return None
    return rid, flag


#: prompt_tokens counts a prompt that is not token ids as this many bytes a token.
BYTES_PER_TOKEN = 4


def prompt_tokens(frame: Frame) -> int:
    """The size in tokens of a prompt frame, from at most its first 5 bytes.

    A msgpack array (token ids) counts its length, its elements unread; a
    msgpack str ``ceil(its UTF-8 bytes / BYTES_PER_TOKEN)``, its declared
    length; anything else (bin, another type, bytes that are not msgpack, a
    header cut short, an empty frame) ``ceil(the frame's bytes /
    BYTES_PER_TOKEN)``. Never raises.
    """
    view = memoryview(cast(Buffer, frame)).cast("B")  # a zmq.Frame exports its buffer too
    n = len(view)
    if n:
        b = view[0]
        if 0x90 <= b <= 0x9F:
            return b & 0x0F
        if b == 0xDC and n >= 3:
            return view[1] << 8 | view[2]
        if b == 0xDD and n >= 5:
            return int.from_bytes(view[1:5], "big")
        text = -1
        if 0xA0 <= b <= 0xBF:
            text = b & 0x1F
        elif b == 0xD9 and n >= 2:
            text = view[1]
        elif b == 0xDA and n >= 3:
            text = view[1] << 8 | view[2]
        elif b == 0xDB and n >= 5:
            text = int.from_bytes(view[1:5], "big")
        if text >= 0:
            return -(-text // BYTES_PER_TOKEN)
    return -(-n // BYTES_PER_TOKEN)


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


def read_rids(frame: Buffer) -> tuple[int, list[int]]:
    """``(header, [rid, ...])`` of ``[header, rid, ...]``, at least one rid, int64s,
    validated whole."""
    data = _as_bytes(frame)
    unpacker, length, header = _start(data, 2)
    rids = [_int(_METADATA, _unpack(_METADATA, unpacker.unpack)) for _ in range(length - 1)]
    if unpacker.tell() != len(data):
        raise ProtocolError(f"{_METADATA}: trailing bytes")
    return header, rids


def _span(what: str, unpacker: msgpack.Unpacker) -> tuple[int, int]:
    """``(offset, size)`` of the object skipped at the unpacker, any msgpack."""
    offset = unpacker.tell()
    _unpack(what, unpacker.skip)
    return offset, unpacker.tell() - offset


def _batch_entries(
    what: str,
    data: bytes,
    header: int,
    widths: tuple[int, ...],
    read_rest: Callable[[msgpack.Unpacker, int], tuple[Any, ...]],
) -> list[tuple[Any, ...]]:
    """The entries of ``[header, [[rid, ...], ...]]``, each as long as one of ``widths``:
    ``(rid, *read_rest(unpacker, width))``. A ProtocolError names in ``rids`` the id of
    every entry read as far as its id."""
    if not data:
        raise ProtocolError(f"{what}: truncated")
    unpacker = msgpack.Unpacker(raw=True, strict_map_key=False, max_buffer_size=len(data))
    unpacker.feed(data)
    if _unpack(what, unpacker.read_array_header) != 2:
        raise ProtocolError(f"{what}: array of the wrong length")
    if _int(what, _unpack(what, unpacker.unpack)) != header:
        raise ProtocolError(f"{what}: unexpected header")
    count = _unpack(what, unpacker.read_array_header)
    entries: list[tuple[Any, ...]] = []
    rids: list[int] = []
    try:
        for _ in range(count):
            width = _unpack(what, unpacker.read_array_header)
            if width not in widths:
                raise ProtocolError(f"{what}: array of the wrong length")
            rids.append(_int(what, _unpack(what, unpacker.unpack), "request id out of range"))
            entries.append((rids[-1], *read_rest(unpacker, width)))
        if unpacker.tell() != len(data):
            raise ProtocolError(f"{what}: trailing bytes")
    except ProtocolError as exc:
        exc.rids = tuple(rids)
        raise
    return entries


def read_submit_batch(frame: Buffer, width: int = 3) -> list[tuple[Any, ...]]:
    """``[(rid, params_offset, params_size, hashed), ...]`` of a SUBMIT_BATCH.

    ``width`` 3: a client's ``[95, [[rid, params, hashed], ...]]``; 2: the
    coordinator's to an engine, ``[95, [[rid, params], ...]]`` (hashed False); 5
    (QOS_WIDTH): a client granted QoS, whose entries may carry them after the rid,
    ``[rid, priority, deadline_ms, params, hashed]``: ``(..., hashed, priority,
    deadline_ms)`` each (0, 0 for an entry without). Each entry's sampling params are
    ``frame[offset : offset + size]``, verbatim.
    A ProtocolError's ``rids`` name the entries whose ids could be read.
    """
    if width not in (2, 3, QOS_WIDTH):
        raise ValueError(f"width must be 2, 3 or 5, not {width!r}")
    what = "malformed SUBMIT_BATCH"

    def rest(unpacker: msgpack.Unpacker, fields: int) -> tuple[Any, ...]:
        qos = _qos(what, unpacker) if fields == QOS_WIDTH else (0, 0)
        offset, size = _span(what, unpacker)
        hashed = _bool(what, _unpack(what, unpacker.unpack)) if width != 2 else False
        return (offset, size, hashed, *qos) if width == QOS_WIDTH else (offset, size, hashed)

    widths = (3, QOS_WIDTH) if width == QOS_WIDTH else (width,)
    return _batch_entries(what, _as_bytes(frame), Header.SUBMIT_BATCH, widths, rest)


def read_reply_batch(frame: Buffer) -> list[tuple[int, bool]]:
    """``[(rid, final), ...]`` of a REPLY_BATCH ``[96, [[rid, final], ...]]``."""
    what = "malformed REPLY_BATCH"

    def final(unpacker: msgpack.Unpacker, _: int) -> tuple[bool]:
        return (_bool(what, _unpack(what, unpacker.unpack)),)

    entries = _batch_entries(what, _as_bytes(frame), Header.REPLY_BATCH, (2,), final)
    return cast(list[tuple[int, bool]], entries)


def read_handoff(frame: Buffer) -> list[tuple[int, int, int]]:
    """``[(rid, kv_meta_offset, kv_meta_size), ...]`` of a HANDOFF ``[104, [[rid,
    kv_meta], ...]]``; each entry's kv_meta is ``frame[offset : offset + size]``,
    verbatim (any msgpack object)."""
    what = "malformed HANDOFF"

    entries = _batch_entries(
        what, _as_bytes(frame), Header.HANDOFF, (2,), lambda unpacker, _: _span(what, unpacker)
    )
    return cast(list[tuple[int, int, int]], entries)


# -- single frame: Megatron-Core's single frames (0.19's, main's), as byte spans ------


# "request_id" as a msgpack str, in each of its four forms.
def _str_keys(name: bytes) -> tuple[bytes, ...]:
    """``name`` (under 32 bytes) as a msgpack str, in each of its four forms."""
    n = len(name)
    heads = (bytes([0xA0 | n]), bytes([0xD9, n]), bytes([0xDA, 0, n]), bytes([0xDB, 0, 0, 0, n]))
    return tuple(head + name for head in heads)


_REQUEST_ID_KEYS = _str_keys(b"request_id")
_NEW_TOKENS_KEYS = _str_keys(b"new_tokens")
_ALL_TOKENS_KEYS = _str_keys(b"generated_tokens")

#: What streamed_tokens found in a reply body: neither "new_tokens" nor
#: "generated_tokens", "new_tokens" (those since the last partial), "generated_tokens"
#: (all so far).
NO_TOKENS, NEW_TOKENS, ALL_TOKENS = 0, 1, 2


def _single_head(data: bytes) -> tuple[msgpack.Unpacker, int, int, int]:
    """An unpacker just past the rid of ``[header, rid, ...]``, an array of 4 to 6."""
    if not data:
        raise ProtocolError(f"{_METADATA}: {_TRUNCATED}")
    unpacker = _unpacker(data)
    length = _array_length(_METADATA, data, unpacker)
    if not 4 <= length <= 6:
        raise ProtocolError(f"{_METADATA}: array of the wrong length")
    header = _int(_METADATA, _unpack(_METADATA, unpacker.unpack))
    rid = _int(_METADATA, _unpack(_METADATA, unpacker.unpack), "request id out of range")
    return unpacker, header, rid, length


def read_single_head(frame: Buffer) -> tuple[int, int, int, int]:
    """``(header, rid, length, prompt)`` of a single-frame SUBMIT ``[header, rid, ...]``,
    read as far as its rid: an array of 4, 5 or 6 (``length``), int64 header and rid.
    Nothing after the rid is read: ``frame[prompt:]`` is the rest, unchecked."""
    unpacker, header, rid, length = _single_head(_as_bytes(frame))
    return header, rid, length, unpacker.tell()


def read_single_submit(frame: Buffer) -> tuple[int, int, int, int, int, int]:
    """``(header, rid, length, prompt, params, extra)`` of a single-frame SUBMIT
    ``[header, rid, prompt, sampling_params, ...]`` of ``length`` fields (4: 0.19's;
    5: main's, multi_modal_data last; 6: main's KV submission, kv_meta and
    src_block_ids last), validated whole.

    ``frame[prompt:params]`` is the prompt (a msgpack str or array),
    ``frame[params:extra]`` the sampling params (a map; and kv_meta, of 6 fields),
    ``frame[extra:]`` the last field (nothing, of 4), all checked for structure
    only. A fault after the rid raises ProtocolError with ``rid`` set.
    """
    data = _as_bytes(frame)
    unpacker, header, rid, length = _single_head(data)
    prompt = unpacker.tell()
    _skip_one(_METADATA, data, unpacker, _is_prompt, rid)
    params = unpacker.tell()
    _skip_one(_METADATA, data, unpacker, _is_map, rid)
    if length == 6:  # kv_meta, then src_block_ids
        _unpack(_METADATA, unpacker.skip, rid)
    extra = unpacker.tell()
    if length > 4:
        _unpack(_METADATA, unpacker.skip, rid)
    if unpacker.tell() != len(data):
        raise ProtocolError(f"{_METADATA}: trailing bytes", rid)
    return header, rid, length, prompt, params, extra if length > 4 else len(data)


def _read_entry(data: bytes, unpacker: msgpack.Unpacker) -> tuple[int | None, str | None]:
    """Skip one reply entry; ``(rid, None)`` for a map with an int64 "request_id"
    among its top-level keys (the last one wins), else ``(None, why)``."""
    at = unpacker.tell()
    if at >= len(data):
        raise ProtocolError(f"{_REPLY}: {_TRUNCATED}")
    if not _is_map(data[at]):
        _unpack(_REPLY, unpacker.skip)
        return None, _NOT_MAP
    rid: int | None = None
    error: str | None = _NO_REQUEST_ID
    for _ in range(_count(_REPLY, data, unpacker, _is_map) // 2):
        at = unpacker.tell()
        is_request_id = data.startswith(_REQUEST_ID_KEYS, at)
        _unpack(_REPLY, unpacker.skip)  # the key
        at = unpacker.tell()
        if not is_request_id:
            _unpack(_REPLY, unpacker.skip)
            continue
        if at < len(data) and _is_int(data[at]):
            value = _unpack(_REPLY, unpacker.unpack)
            if _INT64_MIN <= value <= _INT64_MAX:
                rid, error = value, None
                continue
        else:
            _unpack(_REPLY, unpacker.skip)
        rid, error = None, _BAD_REQUEST_ID
    return rid, error


def read_single_reply(frame: Buffer) -> tuple[int, list[tuple[int, int, int | None, str | None]]]:
    """``(header, entries)`` of a single-frame ENGINE_REPLY ``[21, [map, ...]]`` or
    (Megatron main's) ENGINE_REPLY_PARTIAL ``[22, [map, ...]]``.

    One ``(start, end, rid, error)`` per entry: ``frame[start:end]`` is its
    bytes, ``rid`` its top-level ``"request_id"``, or None with ``error``
    saying why (not a map, no request_id, a request_id that is not an int64).
    A frame that is not valid as a whole raises ProtocolError.
    """
    data = _as_bytes(frame)
    if not data:
        raise ProtocolError(f"{_REPLY}: {_TRUNCATED}")
    unpacker = _unpacker(data)
    if _array_length(_REPLY, data, unpacker) != 2:
        raise ProtocolError(f"{_REPLY}: array of the wrong length")
    header = _int(_REPLY, _unpack(_REPLY, unpacker.unpack))
    if header not in (Header.ENGINE_REPLY, Header.ENGINE_REPLY_PARTIAL):
        raise ProtocolError(f"{_REPLY}: not an engine reply header")
    entries = []
    for _ in range(_count(_REPLY, data, unpacker, _is_array)):
        start = unpacker.tell()
        rid, error = _read_entry(data, unpacker)
        entries.append((start, unpacker.tell(), rid, error))
    if unpacker.tell() != len(data):
        raise ProtocolError(f"{_REPLY}: trailing bytes")
    return header, entries


def streamed_tokens(body: Buffer) -> tuple[int, list[int]]:
    """``(kind, tokens)`` of a reply body (exactly one msgpack map): its top-level
    "new_tokens" (kind NEW_TOKENS), else its "generated_tokens" (ALL_TOKENS), the last
    of each name winning; ``(NO_TOKENS, [])`` with neither. ProtocolError for a body
    that is not one map, or tokens that are not ints in [0, 2**32)."""
    what = "no tokens"
    data = _as_bytes(body)
    unpacker = _unpacker(data)
    found: list[int | None] = [None, None]  # where "new_tokens", "generated_tokens" lie
    for _ in range(_count(what, data, unpacker, _is_map) // 2):
        at = unpacker.tell()
        which = (
            0
            if data.startswith(_NEW_TOKENS_KEYS, at)
            else 1
            if data.startswith(_ALL_TOKENS_KEYS, at)
            else None
        )
        _unpack(what, unpacker.skip)  # the key
        if which is not None:
            found[which] = unpacker.tell()
        _unpack(what, unpacker.skip)
    if unpacker.tell() != len(data):
        raise ProtocolError(f"{what}: trailing bytes")
    which = 0 if found[0] is not None else 1
    at = found[which]
    if at is None:
        return NO_TOKENS, []
    unpacker = _unpacker(data[at:])
    tokens = []
    for _ in range(_array_length(what, data[at:], unpacker)):
        at_token = at + unpacker.tell()
        token = unpacker.unpack() if _is_int(data[at_token]) else None
        if token is None or not 0 <= token <= _UINT32_MAX:
            raise ProtocolError(f"{what}: {_BAD_TOKEN}")
        tokens.append(token)
    return NEW_TOKENS if which == 0 else ALL_TOKENS, tokens


def _check_whole(what: str, frame: Buffer, kind: Callable[[int], bool]) -> None:
    data = _as_bytes(frame)
    unpacker = _unpacker(data)
    _skip_one(what, data, unpacker, kind, None)
    if unpacker.tell() != len(data):
        raise ProtocolError(f"{what}: trailing bytes")


def check_prompt(frame: Buffer) -> None:
    """ProtocolError unless ``frame`` is exactly one msgpack str or array (a prompt)."""
    _check_whole("malformed prompt", frame, _is_prompt)


def check_map(frame: Buffer) -> None:
    """ProtocolError unless ``frame`` is exactly one msgpack map (sampling params, a reply)."""
    _check_whole("malformed map", frame, _is_map)


def _tokens(data: bytes) -> list[int]:
    """The prompt's token ids, or ProtocolError saying why it has none, as the C twin would."""
    what = "no block hashes"
    try:  # the common case at msgpack's speed; any doubt goes the exact way below
        tokens = msgpack.unpackb(data, raw=True, strict_map_key=False)
    except Exception:
        tokens = None
    if type(tokens) is list and all(type(t) is int and 0 <= t <= _UINT32_MAX for t in tokens):
        return tokens
    if not data:
        raise ProtocolError(f"{what}: {_TRUNCATED}")
    if _is_str(data[0]):
        raise ProtocolError(f"{what}: {_PROMPT_STR}")
    unpacker = _unpacker(data)
    tokens = []
    for _ in range(_count(what, data, unpacker, _is_array)):
        at = unpacker.tell()
        if at >= len(data):
            raise ProtocolError(f"{what}: {_TRUNCATED}")
        if not _is_int(data[at]):
            raise ProtocolError(f"{what}: {_BAD_TOKEN}")
        token = _unpack(what, unpacker.unpack)
        if not 0 <= token <= _UINT32_MAX:
            raise ProtocolError(f"{what}: {_BAD_TOKEN}")
        tokens.append(token)
    if unpacker.tell() != len(data):
        raise ProtocolError(f"{what}: trailing bytes")
    return tokens


def _block_size_arg(value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"expected an int, got {type(value).__name__}")
    if not 1 <= value <= _UINT32_MAX:
        raise ValueError(f"block_size must be in 1..2**32-1, not {value}")
    return int(value)


def prompt_hashes(prompt: Buffer, block_size: int) -> bytes:
    """``protocol.block_hashes(tokens, block_size)`` of a prompt that is a msgpack
    array of ints in [0, 2**32), read in place; ProtocolError for any other prompt
    (a str prompt among them: it has no token ids)."""
    size = _block_size_arg(block_size)
    return block_hashes(_tokens(_as_bytes(prompt)), size)


# -- writer: the frames the coordinator and the endpoints write ------------------------

# pack_array_header runs in C without releasing the GIL: one shared Packer is safe.
_packer = msgpack.Packer()


def write_submit(header: int, length: int, rid: int, rest: Buffer) -> bytes:
    """``[header, rid, <rest>]``, an array of ``length`` elements: ``rest`` (the
    other ``length - 2``, already packed) spliced in as it is."""
    if not isinstance(length, int) or isinstance(length, bool):
        raise TypeError(f"expected an int, got {type(length).__name__}")
    if not 2 <= length <= _UINT32_MAX:
        raise ValueError(f"length must be in 2..2**32-1, not {length}")
    head = _packer.pack_array_header(length) + _packer.pack(_int64_arg(header))
    return head + _packer.pack(_int64_arg(rid)) + _as_bytes(rest)


def write_header_int(header: int, value: int) -> bytes:
    """``msgpack.packb([header, value])``."""
    return msgpack.packb([_int64_arg(header), _int64_arg(value)])


def write_single_submit(header: int, rid: int, prompt: Buffer, params: Buffer) -> bytes:
    """``[header, rid, <prompt>, <params>]``: the two byte strings spliced in as
    they are (so ``msgpack.packb([header, rid, p, s])`` when they are ``packb(p)``
    and ``packb(s)``)."""
    head = _packer.pack_array_header(4) + _packer.pack(_int64_arg(header))
    return head + _packer.pack(_int64_arg(rid)) + _as_bytes(prompt) + _as_bytes(params)
