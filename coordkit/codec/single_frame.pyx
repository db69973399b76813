"""Megatron-Core's single frames, 0.19's and main's (included by _codec_c.pyx).

Nothing here decodes a prompt or a reply map: they are skipped structurally
and handed back as byte spans of the frame; and the block hashes of a
token-id prompt, read in place.
"""

cimport cython
from cpython.bool cimport PyBool_Check
from cpython.buffer cimport PyBuffer_Release
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.long cimport PyLong_Check
from libc.stdint cimport UINT32_MAX, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcmp, memset

from ._constants cimport HEADER_ENGINE_REPLY, HEADER_ENGINE_REPLY_PARTIAL
from .includes.blake2b cimport (
    ck_blake2b_final,
    ck_blake2b_init,
    ck_blake2b_state,
    ck_blake2b_update,
    ck_blake2b_update_le32,
)
from .includes.cursor cimport ck_cursor, ck_left, ck_load_be16, ck_load_be32, ck_take

cdef inline bint _is_str(uint8_t b) noexcept nogil:
    return (b & 0xe0) == 0xa0 or b == 0xd9 or b == 0xda or b == 0xdb


cdef inline bint _is_array(uint8_t b) noexcept nogil:
    return (b & 0xf0) == 0x90 or b == 0xdc or b == 0xdd


cdef inline bint _is_map(uint8_t b) noexcept nogil:
    return (b & 0xf0) == 0x80 or b == 0xde or b == 0xdf


cdef enum _Kind:
    _PROMPT     # a str or an array
    _MAP


cdef inline int _skip_one(ck_cursor* c, _Kind kind) noexcept nogil:
    """Skip one object of `kind`; CK_BAD_TYPE, the cursor unmoved, for another type."""
    if ck_left(c) == 0:
        return CK_TRUNCATED
    cdef uint8_t b = c.p[0]
    if not (_is_map(b) if kind == _MAP else _is_str(b) or _is_array(b)):
        return CK_BAD_TYPE
    return _skip(c, 1)


cdef int ck_read_single_head(const uint8_t* buf, size_t n,
                             ck_single_submit* out) noexcept nogil:
    cdef ck_cursor c
    c.p = buf
    c.end = buf + n
    out.prompt = 0
    out.params = 0
    out.extra = 0
    cdef int status = _read_array(&c, &out.length)
    if status != CK_OK:
        return status
    if not 4 <= out.length <= 6:
        return CK_BAD_LENGTH
    status = _read_int(&c, &out.header)
    if status != CK_OK:
        return status
    status = _read_int(&c, &out.rid)
    if status != CK_OK:
        return CK_RID_RANGE if status == CK_RANGE else status
    out.prompt = <size_t>(c.p - buf)
    return CK_OK


cdef int ck_read_single_submit(const uint8_t* buf, size_t n,
                               ck_single_submit* out) noexcept nogil:
    cdef int status = ck_read_single_head(buf, n, out)
    if status != CK_OK:
        return status
    cdef ck_cursor c
    c.p = buf + out.prompt
    c.end = buf + n
    status = _skip_one(&c, _PROMPT)
    if status != CK_OK:
        return status
    out.params = <size_t>(c.p - buf)
    status = _skip_one(&c, _MAP)
    if status == CK_OK and out.length == 6:  # kv_meta, then src_block_ids
        status = _skip(&c, 1)
    if status != CK_OK:
        return status
    out.extra = <size_t>(c.p - buf)
    if out.length > 4:
        status = _skip(&c, 1)
        if status != CK_OK:
            return status
    if c.p != c.end:
        return CK_TRAILING
    if out.length == 4:
        out.extra = n
    return CK_OK


cdef inline size_t _key(const ck_cursor* c, const char* name, size_t size) noexcept nogil:
    """The bytes the str key at c.p takes when it is ``name`` (of ``size`` < 32 bytes, in
    any of a msgpack str's four forms), else 0; c is not moved."""
    cdef size_t left = ck_left(c)
    cdef const uint8_t* p = c.p
    cdef size_t head
    if left < size + 1:
        return 0
    if p[0] == 0xa0 | size:
        head = 1
    elif p[0] == 0xd9 and p[1] == size:
        head = 2
    elif p[0] == 0xda and p[1] == 0 and p[2] == size:
        head = 3
    elif p[0] == 0xdb and p[1] == 0 and p[2] == 0 and p[3] == 0 and p[4] == size:
        head = 5
    else:
        return 0
    if left < head + size or memcmp(p + head, name, size) != 0:
        return 0
    return head + size


cdef inline size_t _request_id_key(const ck_cursor* c) noexcept nogil:
    """The size of the str key at c.p when it is "request_id", else 0; c is not moved."""
    return _key(c, b"request_id", 10)


cdef int _read_single_entry(ck_cursor* c, int64_t* rid, int* entry_status) noexcept nogil:
    """Skip one reply entry, finding the "request_id" of a map among its top-level
    keys; the frame's status (only structure fails it), and the entry's in *entry_status."""
    cdef const uint8_t* p
    cdef uint64_t pairs, _i
    cdef size_t key
    cdef ck_cursor value
    cdef int status
    if ck_left(c) == 0:
        return CK_TRUNCATED
    cdef uint8_t b = c.p[0]
    if not _is_map(b):
        entry_status[0] = CK_NOT_MAP
        return _skip(c, 1)
    c.p += 1
    if b == 0xde or b == 0xdf:
        p = ck_take(c, 2 if b == 0xde else 4)
        if p == NULL:
            return CK_TRUNCATED
        pairs = ck_load_be16(p) if b == 0xde else ck_load_be32(p)
    else:
        pairs = b & 0x0f
    if 2 * pairs > ck_left(c):
        return CK_TRUNCATED
    entry_status[0] = CK_NO_REQUEST_ID
    for _i in range(pairs):
        key = _request_id_key(c)
        if key == 0:
            status = _skip(c, 2)
        else:
            c.p += key
            value = c[0]
            # the last "request_id" wins, as in the map msgpack decodes
            if _read_int(&value, rid) == CK_OK:
                entry_status[0] = CK_OK
            else:
                entry_status[0] = CK_BAD_REQUEST_ID
            status = _skip(c, 1)
        if status != CK_OK:
            return status
    return CK_OK


cdef int ck_read_single_reply(const uint8_t* buf, size_t n, int64_t* header,
                              ck_single_entry* entries, uint32_t capacity,
                              uint32_t* count) noexcept nogil:
    cdef ck_cursor c
    c.p = buf
    c.end = buf + n
    cdef uint32_t length, i
    cdef int64_t rid
    cdef int entry_status
    cdef const uint8_t* start
    count[0] = 0
    cdef int status = _read_array(&c, &length)
    if status != CK_OK:
        return status
    if length != 2:
        return CK_BAD_LENGTH
    status = _read_int(&c, header)
    if status != CK_OK:
        return status
    if header[0] != HEADER_ENGINE_REPLY and header[0] != HEADER_ENGINE_REPLY_PARTIAL:
        return CK_BAD_HEADER
    status = _read_array(&c, &length)
    if status != CK_OK:
        return status
    if length > ck_left(&c):
        return CK_TRUNCATED
    for i in range(length):
        start = c.p
        rid = 0
        status = _read_single_entry(&c, &rid, &entry_status)
        if status != CK_OK:
            return status
        if i < capacity:
            entries[i].offset = <size_t>(start - buf)
            entries[i].size = <size_t>(c.p - start)
            entries[i].rid = rid if entry_status == CK_OK else 0
            entries[i].status = entry_status
    if c.p != c.end:
        return CK_TRAILING
    count[0] = length
    return CK_TOO_MANY if length > capacity else CK_OK


cdef inline int _check_whole(const uint8_t* buf, size_t n, _Kind kind) noexcept nogil:
    cdef ck_cursor c
    c.p = buf
    c.end = buf + n
    cdef int status = _skip_one(&c, kind)
    if status != CK_OK:
        return status
    return CK_OK if c.p == c.end else CK_TRAILING


cdef int ck_streamed_tokens(const uint8_t* buf, size_t n, int* kind, uint32_t* out,
                            uint32_t capacity, uint32_t* count) noexcept nogil:
    """The tokens a reply body (exactly one msgpack map) carries: its top-level
    "new_tokens" (*kind CK_NEW_TOKENS: those since the last partial, as Megatron's
    partials carry them), else its "generated_tokens" (CK_ALL_TOKENS: all so far),
    the last of each name winning; *kind CK_NO_TOKENS and *count 0 with neither."""
    cdef ck_cursor c
    cdef ck_cursor found[2]  # the values of "new_tokens", "generated_tokens"
    cdef bint has[2]
    cdef const uint8_t* p
    cdef uint64_t pairs, _i
    cdef uint32_t length, j
    cdef size_t key
    cdef int status, which
    cdef int64_t token
    c.p = buf
    c.end = buf + n
    count[0] = 0
    kind[0] = CK_NO_TOKENS
    has[0] = has[1] = False
    if ck_left(&c) == 0:
        return CK_TRUNCATED
    cdef uint8_t b = c.p[0]
    if not _is_map(b):
        return CK_BAD_TYPE
    c.p += 1
    if b == 0xde or b == 0xdf:
        p = ck_take(&c, 2 if b == 0xde else 4)
        if p == NULL:
            return CK_TRUNCATED
        pairs = ck_load_be16(p) if b == 0xde else ck_load_be32(p)
    else:
        pairs = b & 0x0f
    if 2 * pairs > ck_left(&c):
        return CK_TRUNCATED
    for _i in range(pairs):
        which = 0
        key = _key(&c, b"new_tokens", 10)
        if key == 0:
            which = 1
            key = _key(&c, b"generated_tokens", 16)
        if key == 0:
            status = _skip(&c, 2)
        else:
            c.p += key
            found[which] = c
            has[which] = True
            status = _skip(&c, 1)
        if status != CK_OK:
            return status
    if ck_left(&c) != 0:
        return CK_TRAILING
    which = 0 if has[0] else 1
    if not has[which]:
        return CK_OK
    kind[0] = CK_NEW_TOKENS if which == 0 else CK_ALL_TOKENS
    status = _read_array(&found[which], &length)
    if status != CK_OK:
        return status
    count[0] = length
    if length > capacity:
        return CK_TOO_MANY
    for j in range(length):
        status = _read_int(&found[which], &token)
        if status != CK_OK or token < 0 or token > <int64_t>UINT32_MAX:
            count[0] = 0
            return CK_BAD_TOKEN
        out[j] = <uint32_t>token
    return CK_OK


cdef int ck_check_prompt(const uint8_t* buf, size_t n) noexcept nogil:
    return _check_whole(buf, n, _PROMPT)


cdef int ck_check_map(const uint8_t* buf, size_t n) noexcept nogil:
    return _check_whole(buf, n, _MAP)


@cython.cdivision(True)
cdef int ck_prompt_hashes(const uint8_t* buf, size_t n, size_t block_size, uint8_t* out,
                          size_t capacity, size_t* count) noexcept nogil:
    cdef ck_cursor c
    c.p = buf
    c.end = buf + n
    cdef uint32_t length, _i
    cdef size_t full          # the full blocks: one hash each
    cdef size_t in_block = 0  # tokens of the block being hashed
    cdef size_t blocks = 0    # hashes written
    cdef int64_t token
    cdef size_t left
    cdef uint8_t b
    cdef ck_blake2b_state state
    cdef uint8_t zero[8]
    count[0] = 0
    if block_size == 0:
        return CK_BAD_LENGTH
    if ck_left(&c) == 0:
        return CK_TRUNCATED
    if _is_str(c.p[0]):
        return CK_PROMPT_STR
    cdef int status = _read_array(&c, &length)
    if status != CK_OK:
        return status
    if length > ck_left(&c):
        return CK_TRUNCATED
    full = length / block_size
    if full > capacity:
        count[0] = full
        return CK_TOO_MANY
    for _i in range(length):
        if in_block == 0 and blocks < full:
            # a full block starts: h[i] = blake2b(h[i-1] LE ‖ tokens as u32 LE), h[-1] = 0
            ck_blake2b_init(&state, 8)
            if blocks == 0:
                memset(zero, 0, 8)
                ck_blake2b_update(&state, zero, 8)
            else:
                ck_blake2b_update(&state, out + 8 * (blocks - 1), 8)
        # the forms packb gives token ids, inline; any other int form the long way
        left = ck_left(&c)
        b = c.p[0] if left else 0
        if left and b < 0x80:
            token = b
            c.p += 1
        elif b == 0xcd and left >= 3:
            token = ck_load_be16(c.p + 1)
            c.p += 3
        elif b == 0xce and left >= 5:
            token = ck_load_be32(c.p + 1)
            c.p += 5
        else:
            status = _read_int(&c, &token)
            if status == CK_TRUNCATED:
                return status
            if status != CK_OK or token < 0 or token > <int64_t>UINT32_MAX:
                return CK_BAD_TOKEN
        if blocks < full:
            ck_blake2b_update_le32(&state, <uint32_t>token)
            in_block += 1
            if in_block == block_size:
                ck_blake2b_final(&state, out + 8 * blocks)
                blocks += 1
                in_block = 0
    if c.p != c.end:
        return CK_TRAILING
    count[0] = blocks
    return CK_OK


# -- the Python API ---------------------------------------------------------------

def read_single_submit(frame) -> tuple[int, int, int, int, int, int]:
    """``(header, rid, length, prompt, params, extra)`` of a single-frame SUBMIT
    ``[header, rid, prompt, sampling_params, ...]`` of ``length`` fields (4: 0.19's;
    5: main's, multi_modal_data last; 6: main's KV submission, kv_meta and
    src_block_ids last), validated whole.

    ``frame[prompt:params]`` is the prompt (a msgpack str or array),
    ``frame[params:extra]`` the sampling params (a map; and kv_meta, of 6 fields),
    ``frame[extra:]`` the last field (nothing, of 4), all checked for structure
    only. A fault after the rid raises ProtocolError with ``rid`` set.
    """
    cdef Py_buffer view
    cdef ck_single_submit s
    _acquire(frame, &view)
    cdef int status = ck_read_single_submit(<const uint8_t*>view.buf, view.len, &s)
    PyBuffer_Release(&view)
    if status != CK_OK:
        raise _error("malformed metadata frame", status, s.rid if s.prompt else None)
    return s.header, s.rid, s.length, s.prompt, s.params, s.extra


def read_single_head(frame) -> tuple[int, int, int, int]:
    """``(header, rid, length, prompt)`` of a single-frame SUBMIT ``[header, rid, ...]``,
    read as far as its rid: an array of 4, 5 or 6 (``length``), int64 header and rid.
    Nothing after the rid is read: ``frame[prompt:]`` is the rest, unchecked."""
    cdef Py_buffer view
    cdef ck_single_submit s
    _acquire(frame, &view)
    cdef int status = ck_read_single_head(<const uint8_t*>view.buf, view.len, &s)
    PyBuffer_Release(&view)
    if status != CK_OK:
        raise _error("malformed metadata frame", status)
    return s.header, s.rid, s.length, s.prompt


def read_single_reply(frame) -> tuple[int, list[tuple[int, int, int | None, str | None]]]:
    """``(header, entries)`` of a single-frame ENGINE_REPLY ``[21, [map, ...]]`` or
    (Megatron main's) ENGINE_REPLY_PARTIAL ``[22, [map, ...]]``.

    One ``(start, end, rid, error)`` per entry: ``frame[start:end]`` is its
    bytes, ``rid`` its top-level ``"request_id"``, or None with ``error``
    saying why (not a map, no request_id, a request_id that is not an int64).
    A frame that is not valid as a whole raises ProtocolError.
    """
    cdef Py_buffer view
    cdef ck_single_entry local[_LOCAL_ENTRIES]
    cdef ck_single_entry* entries = local
    cdef uint32_t count, i
    cdef int64_t header
    _acquire(frame, &view)
    cdef const uint8_t* buf = <const uint8_t*>view.buf
    cdef int status = ck_read_single_reply(buf, view.len, &header, local, _LOCAL_ENTRIES, &count)
    if status == CK_TOO_MANY:
        entries = <ck_single_entry*>malloc(count * sizeof(ck_single_entry))
        if entries == NULL:
            PyBuffer_Release(&view)
            raise MemoryError()
        status = ck_read_single_reply(buf, view.len, &header, entries, count, &count)
    PyBuffer_Release(&view)
    try:
        if status != CK_OK:
            raise _error("malformed engine reply", status)
        return header, [
            (
                entries[i].offset,
                entries[i].offset + entries[i].size,
                entries[i].rid if entries[i].status == CK_OK else None,
                None if entries[i].status == CK_OK else ck_strstatus(entries[i].status).decode(),
            )
            for i in range(count)
        ]
    finally:
        if entries != local:
            free(entries)


def check_prompt(frame) -> None:
    """ProtocolError unless ``frame`` is exactly one msgpack str or array (a prompt)."""
    cdef Py_buffer view
    _acquire(frame, &view)
    cdef int status = ck_check_prompt(<const uint8_t*>view.buf, view.len)
    PyBuffer_Release(&view)
    if status != CK_OK:
        raise _error("malformed prompt", status)


def check_map(frame) -> None:
    """ProtocolError unless ``frame`` is exactly one msgpack map (sampling params, a reply)."""
    cdef Py_buffer view
    _acquire(frame, &view)
    cdef int status = ck_check_map(<const uint8_t*>view.buf, view.len)
    PyBuffer_Release(&view)
    if status != CK_OK:
        raise _error("malformed map", status)


def streamed_tokens(body) -> tuple[int, list[int]]:
    """``(kind, tokens)`` of a reply body (exactly one msgpack map): its top-level
    "new_tokens" (kind CK_NEW_TOKENS), else its "generated_tokens" (CK_ALL_TOKENS), the
    last of each name winning; ``(CK_NO_TOKENS, [])`` with neither. ProtocolError for
    a body that is not one map, or tokens that are not ints in [0, 2**32)."""
    cdef Py_buffer view
    cdef int kind
    cdef uint32_t count
    cdef uint32_t* out = NULL
    _acquire(body, &view)
    cdef const uint8_t* buf = <const uint8_t*>view.buf
    cdef int status = ck_streamed_tokens(buf, view.len, &kind, NULL, 0, &count)
    try:
        if status == CK_TOO_MANY:
            out = <uint32_t*>malloc(count * sizeof(uint32_t))
            if out == NULL:
                raise MemoryError()
            status = ck_streamed_tokens(buf, view.len, &kind, out, count, &count)
        if status != CK_OK:
            raise _error("no tokens", status)
        return kind, [out[i] for i in range(count)]
    finally:
        PyBuffer_Release(&view)
        free(out)


cdef inline size_t _block_size_arg(object value) except 0:
    if not PyLong_Check(value) or PyBool_Check(value):
        raise TypeError(f"expected an int, got {type(value).__name__}")
    if not 1 <= value <= UINT32_MAX:
        raise ValueError(f"block_size must be in 1..2**32-1, not {value}")
    return <size_t>value


def prompt_hashes(prompt, block_size) -> bytes:
    """``protocol.block_hashes(tokens, block_size)`` of a prompt that is a msgpack
    array of ints in [0, 2**32), read in place; ProtocolError for any other prompt
    (a str prompt among them: it has no token ids)."""
    cdef size_t size = _block_size_arg(block_size)
    cdef Py_buffer view
    cdef size_t count
    cdef bytes out = b""
    _acquire(prompt, &view)
    cdef const uint8_t* buf = <const uint8_t*>view.buf
    # capacity 0 first: CK_TOO_MANY says how many hashes to make room for
    cdef int status = ck_prompt_hashes(buf, view.len, size, NULL, 0, &count)
    try:
        if status == CK_TOO_MANY:
            out = PyBytes_FromStringAndSize(NULL, 8 * count)
            status = ck_prompt_hashes(
                buf, view.len, size, <uint8_t*>PyBytes_AS_STRING(out), count, &count
            )
    finally:
        PyBuffer_Release(&view)
    if status != CK_OK:
        raise _error("no block hashes", status)
    return out
