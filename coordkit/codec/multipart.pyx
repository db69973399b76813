"""The metadata frames of the multipart protocol (included by _codec_c.pyx).

A SUBMIT read as far as its rid and skipped structurally after it, an
engine's reply batch (salvaged entry by entry), ``[header, int]``, the
batches of coordkit's own endpoints, and a prompt frame's size in tokens.
"""

from cpython.buffer cimport PyBuffer_Release
from libc.stdint cimport UINT32_MAX, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc

from ._constants cimport (
    PRIORITY_MAX,
    PRIORITY_MIN,
    HEADER_ENGINE_REPLY,
    HEADER_ENGINE_REPLY_PARTIAL,
    HEADER_HANDOFF,
    HEADER_REPLY_BATCH,
    HEADER_SUBMIT_BATCH,
)
from .includes.bytebuf cimport reserve
from .includes.cursor cimport ck_cursor, ck_left, ck_load_be16, ck_load_be32, ck_take

cdef int ck_read_header(const uint8_t* buf, size_t n, int64_t* header, uint32_t* length,
                        size_t* end) noexcept nogil:
    cdef ck_cursor c
    c.p = buf
    c.end = buf + n
    cdef int status = _read_array(&c, length)
    if status != CK_OK:
        return status
    if length[0] == 0:
        return CK_BAD_LENGTH
    status = _read_int(&c, header)
    if status != CK_OK:
        return status
    end[0] = <size_t>(c.p - buf)
    return CK_OK


cdef int ck_read_submit(const uint8_t* buf, size_t n, ck_submit* out) noexcept nogil:
    cdef ck_cursor c
    c.p = buf
    c.end = buf + n
    out.offset = 0
    cdef int status = _read_array(&c, &out.length)
    if status != CK_OK:
        return status
    if out.length < 2:
        return CK_BAD_LENGTH
    status = _read_int(&c, &out.header)
    if status != CK_OK:
        return status
    status = _read_int(&c, &out.rid)
    if status != CK_OK:
        return CK_RID_RANGE if status == CK_RANGE else status
    out.offset = <size_t>(c.p - buf)
    status = _skip(&c, out.length - 2)
    if status != CK_OK:
        return status
    if c.p != c.end:
        return CK_TRAILING
    return CK_OK


cdef inline int _read_qos(ck_cursor* c, ck_qos* out) noexcept nogil:
    """``priority, deadline_ms``: two ints, the priority in its range, the deadline >= 0."""
    cdef int status = _read_int(c, &out.priority)
    if status == CK_OK:
        status = _read_int(c, &out.deadline_ms)
    if status == CK_RANGE:
        return CK_QOS_RANGE
    if status != CK_OK:
        return status
    if not PRIORITY_MIN <= out.priority <= PRIORITY_MAX or out.deadline_ms < 0:
        return CK_QOS_RANGE
    return CK_OK


cdef int ck_read_qos(const uint8_t* buf, size_t n, ck_submit* submit,
                     ck_qos* out) noexcept nogil:
    cdef ck_cursor c
    c.p = buf + submit.offset
    c.end = buf + n
    cdef int status = _read_qos(&c, out)
    if status == CK_OK:
        submit.offset = <size_t>(c.p - buf)
    return status


cdef int ck_read_reply(const uint8_t* buf, size_t n, int64_t* header, ck_entry* entries,
                       uint32_t capacity, uint32_t* count) noexcept nogil:
    cdef ck_cursor c
    c.p = buf
    c.end = buf + n
    cdef uint32_t length, i
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
    cdef bint full = header[0] == HEADER_ENGINE_REPLY
    cdef ck_entry entry
    for i in range(length):
        start = c.p
        entry.valid = _read_entry(&c, full, &entry) == CK_OK
        if not entry.valid:
            # a well-formed object of the wrong shape: skipped, the rest still read
            c.p = start
            status = _skip(&c, 1)
            if status != CK_OK:
                return status
        if i < capacity:
            entries[i] = entry
    if c.p != c.end:
        return CK_TRAILING
    count[0] = length
    return CK_TOO_MANY if length > capacity else CK_OK


cdef inline int _read_entry(ck_cursor* c, bint full, ck_entry* entry) noexcept nogil:
    """One entry of a batch: ``[rid, needs_detokenize]`` (full) or ``rid``."""
    cdef uint32_t pair
    cdef const uint8_t* p
    cdef int status
    entry.needs_detokenize = False
    if full:
        status = _read_array(c, &pair)
        if status != CK_OK:
            return status
        if pair != 2:
            return CK_BAD_LENGTH
    status = _read_int(c, &entry.rid)
    if status != CK_OK:
        return status
    if full:
        p = ck_take(c, 1)
        if p == NULL:
            return CK_TRUNCATED
        if p[0] != 0xc2 and p[0] != 0xc3:
            return CK_BAD_TYPE
        entry.needs_detokenize = p[0] == 0xc3
    return CK_OK


cdef inline int _read_head(ck_cursor* c, const uint8_t* buf, size_t n, uint32_t least,
                           uint32_t most, uint32_t* length, int64_t* header) noexcept nogil:
    """``[header, ...`` of ``least`` to ``most`` elements, the cursor past the header."""
    c.p = buf
    c.end = buf + n
    cdef int status = _read_array(c, length)
    if status != CK_OK:
        return status
    if not least <= length[0] <= most:
        return CK_BAD_LENGTH
    return _read_int(c, header)


cdef int ck_read_header_int(const uint8_t* buf, size_t n, int64_t* header,
                            int64_t* value) noexcept nogil:
    cdef ck_cursor c
    cdef uint32_t length
    cdef int status = _read_head(&c, buf, n, 2, 2, &length, header)
    if status != CK_OK:
        return status
    status = _read_int(&c, value)
    if status != CK_OK:
        return status
    return CK_OK if c.p == c.end else CK_TRAILING


cdef int ck_read_rids(const uint8_t* buf, size_t n, int64_t* header, uint32_t* count,
                      size_t* first) noexcept nogil:
    cdef ck_cursor c
    cdef uint32_t length, _i
    cdef int64_t rid
    cdef int status = _read_head(&c, buf, n, 2, UINT32_MAX, &length, header)
    if status != CK_OK:
        return status
    first[0] = <size_t>(c.p - buf)
    for _i in range(length - 1):
        status = _read_int(&c, &rid)
        if status != CK_OK:
            return status
    count[0] = length - 1
    return CK_OK if c.p == c.end else CK_TRAILING


cdef inline int _read_batch_head(ck_cursor* c, int64_t expected, uint32_t* length) noexcept nogil:
    """``[expected, [`` up to the entries; *length is their count."""
    cdef int64_t header
    cdef int status = _read_array(c, length)
    if status != CK_OK:
        return status
    if length[0] != 2:
        return CK_BAD_LENGTH
    status = _read_int(c, &header)
    if status != CK_OK:
        return status
    if header != expected:
        return CK_BAD_HEADER
    # Not checked against the bytes left: a short batch still names the ids it holds.
    return _read_array(c, length)


cdef inline void _name_entry(ck_batch_entry* entries, uint32_t capacity, uint32_t* count,
                             uint32_t i, int64_t rid) noexcept nogil:
    """Entry i's id is read: it counts, so that a fault further on can name it."""
    if i < capacity:
        entries[i].rid = rid
    count[0] = i + 1


cdef inline int _read_params_batch(const uint8_t* buf, size_t n, int64_t header,
                                   uint32_t width, ck_batch_entry* entries,
                                   uint32_t capacity, uint32_t* count) noexcept nogil:
    """``[header, [[rid, object, ...], ...]]``: a SUBMIT_BATCH's, or a HANDOFF's (width
    2, its object the kv_meta), each object's span in params_offset/params_size."""
    cdef ck_cursor c
    cdef uint32_t length, i, fields
    cdef ck_batch_entry entry
    cdef const uint8_t* params
    c.p = buf
    c.end = buf + n
    count[0] = 0
    entry.flag = False
    cdef int status = _read_batch_head(&c, header, &length)
    if status != CK_OK:
        return status
    for i in range(length):
        status = _read_array(&c, &fields)
        if status != CK_OK:
            return status
        if fields != width and not (width == CK_QOS_WIDTH and fields == 3):
            return CK_BAD_LENGTH
        status = _read_int(&c, &entry.rid)
        if status != CK_OK:
            return CK_RID_RANGE if status == CK_RANGE else status
        _name_entry(entries, capacity, count, i, entry.rid)
        entry.qos.priority = entry.qos.deadline_ms = 0
        if fields == CK_QOS_WIDTH:
            status = _read_qos(&c, &entry.qos)
            if status != CK_OK:
                return status
        params = c.p
        status = _skip(&c, 1)
        if status != CK_OK:
            return status
        entry.params_offset = <size_t>(params - buf)
        entry.params_size = <size_t>(c.p - params)
        if width != 2:
            status = _read_bool(&c, &entry.flag)
            if status != CK_OK:
                return status
        if i < capacity:
            entries[i] = entry
    if c.p != c.end:
        return CK_TRAILING
    return CK_TOO_MANY if length > capacity else CK_OK


cdef int ck_read_submit_batch(const uint8_t* buf, size_t n, uint32_t width,
                              ck_batch_entry* entries, uint32_t capacity,
                              uint32_t* count) noexcept nogil:
    return _read_params_batch(buf, n, HEADER_SUBMIT_BATCH, width, entries, capacity, count)


cdef int ck_read_handoff(const uint8_t* buf, size_t n, ck_batch_entry* entries,
                         uint32_t capacity, uint32_t* count) noexcept nogil:
    return _read_params_batch(buf, n, HEADER_HANDOFF, 2, entries, capacity, count)


cdef int ck_read_reply_batch(const uint8_t* buf, size_t n, ck_batch_entry* entries,
                             uint32_t capacity, uint32_t* count) noexcept nogil:
    cdef ck_cursor c
    cdef uint32_t length, i, fields
    cdef ck_batch_entry entry
    c.p = buf
    c.end = buf + n
    count[0] = 0
    entry.params_offset = 0
    entry.params_size = 0
    cdef int status = _read_batch_head(&c, HEADER_REPLY_BATCH, &length)
    if status != CK_OK:
        return status
    for i in range(length):
        status = _read_array(&c, &fields)
        if status != CK_OK:
            return status
        if fields != 2:
            return CK_BAD_LENGTH
        status = _read_int(&c, &entry.rid)
        if status != CK_OK:
            return CK_RID_RANGE if status == CK_RANGE else status
        _name_entry(entries, capacity, count, i, entry.rid)
        status = _read_bool(&c, &entry.flag)
        if status != CK_OK:
            return status
        if i < capacity:
            entries[i] = entry
    if c.p != c.end:
        return CK_TRAILING
    return CK_TOO_MANY if length > capacity else CK_OK


cdef inline int _read_batch(const uint8_t* buf, size_t n, int64_t header, uint32_t width,
                            ck_batch_entry* entries, uint32_t capacity,
                            uint32_t* count) noexcept nogil:
    if header == HEADER_SUBMIT_BATCH:
        return ck_read_submit_batch(buf, n, width, entries, capacity, count)
    if header == HEADER_HANDOFF:
        return ck_read_handoff(buf, n, entries, capacity, count)
    return ck_read_reply_batch(buf, n, entries, capacity, count)


cdef int ck_read_batch_into(const uint8_t* buf, size_t n, int64_t header, uint32_t width,
                            ck_batch_entry** entries, uint32_t* capacity,
                            uint32_t* count) noexcept nogil:
    cdef size_t room = capacity[0]
    cdef int status = _read_batch(buf, n, header, width, entries[0], capacity[0], count)
    if count[0] > capacity[0]:
        if reserve(<void**>entries, &room, count[0], sizeof(ck_batch_entry)):
            capacity[0] = <uint32_t>(room if room < UINT32_MAX else UINT32_MAX)
            status = _read_batch(buf, n, header, width, entries[0], capacity[0], count)
    if count[0] > capacity[0]:  # out of memory to grow: name only the entries held
        count[0] = capacity[0]
        return CK_TOO_MANY
    return status


cdef enum:
    _BYTES_PER_TOKEN = 4

#: prompt_tokens counts a prompt that is not token ids as this many bytes a token.
BYTES_PER_TOKEN = _BYTES_PER_TOKEN


cdef inline uint64_t _ceil_tokens(uint64_t n_bytes) noexcept nogil:
    return n_bytes // _BYTES_PER_TOKEN + (n_bytes % _BYTES_PER_TOKEN != 0)


cdef uint64_t ck_prompt_tokens(const uint8_t* buf, size_t n) noexcept nogil:
    cdef uint8_t b
    if n:
        b = buf[0]
        if (b & 0xf0) == 0x90:
            return b & 0x0f
        if b == 0xdc and n >= 3:
            return ck_load_be16(buf + 1)
        if b == 0xdd and n >= 5:
            return ck_load_be32(buf + 1)
        if (b & 0xe0) == 0xa0:
            return _ceil_tokens(b & 0x1f)
        if b == 0xd9 and n >= 2:
            return _ceil_tokens(buf[1])
        if b == 0xda and n >= 3:
            return _ceil_tokens(ck_load_be16(buf + 1))
        if b == 0xdb and n >= 5:
            return _ceil_tokens(ck_load_be32(buf + 1))
    return _ceil_tokens(n)


# -- the Python API ---------------------------------------------------------------

def read_header(frame) -> tuple[int, int, int]:
    """``(header, length, end)`` of a metadata frame ``[header, ...]``.

    ``end`` is the offset just after the header int; nothing after it is read.
    """
    cdef Py_buffer view
    cdef int64_t header
    cdef uint32_t length
    cdef size_t end
    _acquire(frame, &view)
    cdef int status = ck_read_header(<const uint8_t*>view.buf, view.len, &header, &length, &end)
    PyBuffer_Release(&view)
    if status != CK_OK:
        raise _error("malformed metadata frame", status)
    return header, length, end


def read_submit(frame) -> tuple[int, int, int, int]:
    """``(header, length, rid, offset)`` of ``[header, rid, *rest]``, validated whole.

    ``rest`` may hold any msgpack objects; ``offset`` is where they start.
    A fault after the rid raises ProtocolError with ``rid`` set.
    """
    cdef Py_buffer view
    cdef ck_submit s
    _acquire(frame, &view)
    cdef int status = ck_read_submit(<const uint8_t*>view.buf, view.len, &s)
    PyBuffer_Release(&view)
    if status != CK_OK:
        raise _error("malformed metadata frame", status, s.rid if s.offset else None)
    return s.header, s.length, s.rid, s.offset


def read_qos(frame, offset) -> tuple[int, int, int]:
    """``(priority, deadline_ms, end)`` of the QoS fields at ``offset`` of a SUBMIT read
    whole by read_submit (``offset`` its rest's start); ``frame[end:]`` is its params.
    ProtocolError unless they are two ints, the priority in [PRIORITY_MIN,
    PRIORITY_MAX], the deadline >= 0."""
    cdef Py_buffer view
    cdef ck_submit s
    cdef ck_qos qos
    _acquire(frame, &view)
    if not 0 <= offset <= view.len:
        PyBuffer_Release(&view)
        raise ValueError(f"offset {offset} is outside the frame")
    s.offset = offset
    cdef int status = ck_read_qos(<const uint8_t*>view.buf, view.len, &s, &qos)
    PyBuffer_Release(&view)
    if status != CK_OK:
        raise _error("malformed metadata frame", status)
    return qos.priority, qos.deadline_ms, s.offset


def read_reply(frame) -> tuple[int, list[tuple[int, bool] | None]]:
    """``(header, entries)`` of an engine's batch, one entry per body frame.

    ``[21, [[rid, needs_detokenize], ...]]`` or ``[22, [rid, ...]]``, whose
    entries come back as ``(rid, False)``. An entry that is well-formed
    msgpack but not of that shape (or whose rid does not fit int64) comes
    back as ``None``; ProtocolError only when the batch itself cannot be read.
    """
    cdef Py_buffer view
    cdef ck_entry local[_LOCAL_ENTRIES]
    cdef ck_entry* entries = local
    cdef int64_t header
    cdef uint32_t count, i
    _acquire(frame, &view)
    cdef const uint8_t* buf = <const uint8_t*>view.buf
    cdef int status = ck_read_reply(buf, view.len, &header, local, _LOCAL_ENTRIES, &count)
    if status == CK_TOO_MANY:
        entries = <ck_entry*>malloc(count * sizeof(ck_entry))
        if entries == NULL:
            PyBuffer_Release(&view)
            raise MemoryError()
        status = ck_read_reply(buf, view.len, &header, entries, count, &count)
    PyBuffer_Release(&view)
    try:
        if status != CK_OK:
            raise _error("malformed engine reply", status)
        return header, [
            (entries[i].rid, entries[i].needs_detokenize) if entries[i].valid else None
            for i in range(count)
        ]
    finally:
        if entries != local:
            free(entries)


def prompt_tokens(frame) -> int:
    """The size in tokens of a prompt frame, from at most its first 5 bytes.

    A msgpack array (token ids) counts its length, its elements unread; a
    msgpack str ``ceil(its UTF-8 bytes / BYTES_PER_TOKEN)``, its declared
    length; anything else (bin, another type, bytes that are not msgpack, a
    header cut short, an empty frame) ``ceil(the frame's bytes /
    BYTES_PER_TOKEN)``. Never raises.
    """
    cdef Py_buffer view
    _acquire(frame, &view)
    cdef uint64_t tokens = ck_prompt_tokens(<const uint8_t*>view.buf, view.len)
    PyBuffer_Release(&view)
    return tokens


def read_header_int(frame) -> tuple[int, int]:
    """``(header, value)`` of ``[header, value]``, two int64s, validated whole."""
    cdef Py_buffer view
    cdef int64_t header, value
    _acquire(frame, &view)
    cdef int status = ck_read_header_int(<const uint8_t*>view.buf, view.len, &header, &value)
    PyBuffer_Release(&view)
    if status != CK_OK:
        raise _error("malformed metadata frame", status)
    return header, value


def read_rids(frame) -> tuple[int, list[int]]:
    """``(header, [rid, ...])`` of ``[header, rid, ...]``, at least one rid, int64s,
    validated whole."""
    cdef Py_buffer view
    cdef int64_t header, rid = 0
    cdef uint32_t count, _i
    cdef size_t first
    cdef ck_cursor c
    cdef int status
    _acquire(frame, &view)
    try:
        status = ck_read_rids(<const uint8_t*>view.buf, view.len, &header, &count, &first)
        if status != CK_OK:
            raise _error("malformed metadata frame", status)
        c.p = <const uint8_t*>view.buf + first
        c.end = <const uint8_t*>view.buf + view.len
        rids = []
        for _i in range(count):
            _read_int(&c, &rid)
            rids.append(rid)
        return header, rids
    finally:
        PyBuffer_Release(&view)


cdef list _batch_entries(str what, object frame, int64_t header, uint32_t width):
    cdef Py_buffer view
    cdef uint32_t capacity = _LOCAL_ENTRIES, count, i
    cdef ck_batch_entry* entries = <ck_batch_entry*>malloc(capacity * sizeof(ck_batch_entry))
    cdef int status
    if entries == NULL:
        raise MemoryError()
    _acquire(frame, &view)
    try:
        status = ck_read_batch_into(
            <const uint8_t*>view.buf, view.len, header, width, &entries, &capacity, &count
        )
        if status != CK_OK:
            error = _error(what, status)
            error.rids = tuple([entries[i].rid for i in range(count)])
            raise error
        if header == HEADER_SUBMIT_BATCH and width == CK_QOS_WIDTH:
            return [
                (entries[i].rid, entries[i].params_offset, entries[i].params_size,
                 entries[i].flag, entries[i].qos.priority, entries[i].qos.deadline_ms)
                for i in range(count)
            ]
        if header == HEADER_SUBMIT_BATCH:
            return [
                (entries[i].rid, entries[i].params_offset, entries[i].params_size,
                 entries[i].flag)
                for i in range(count)
            ]
        if header == HEADER_HANDOFF:
            return [
                (entries[i].rid, entries[i].params_offset, entries[i].params_size)
                for i in range(count)
            ]
        return [(entries[i].rid, entries[i].flag) for i in range(count)]
    finally:
        PyBuffer_Release(&view)
        free(entries)


def read_submit_batch(frame, width=3) -> list[tuple]:
    """``[(rid, params_offset, params_size, hashed), ...]`` of a SUBMIT_BATCH.

    ``width`` 3: a client's ``[95, [[rid, params, hashed], ...]]``; 2: the
    coordinator's to an engine, ``[95, [[rid, params], ...]]`` (hashed False); 5: a
    client granted QoS, whose entries may carry them after the rid, ``[rid, priority,
    deadline_ms, params, hashed]``: ``(..., hashed, priority, deadline_ms)`` each (0, 0
    for an entry without). Each entry's sampling params are
    ``frame[offset : offset + size]``, verbatim.
    """
    if width != 2 and width != 3 and width != CK_QOS_WIDTH:
        raise ValueError(f"width must be 2, 3 or 5, not {width!r}")
    return _batch_entries("malformed SUBMIT_BATCH", frame, HEADER_SUBMIT_BATCH, width)


def read_reply_batch(frame) -> list[tuple[int, bool]]:
    """``[(rid, final), ...]`` of a REPLY_BATCH ``[96, [[rid, final], ...]]``."""
    return _batch_entries("malformed REPLY_BATCH", frame, HEADER_REPLY_BATCH, 2)


def read_handoff(frame) -> list[tuple[int, int, int]]:
    """``[(rid, kv_meta_offset, kv_meta_size), ...]`` of a HANDOFF ``[104, [[rid,
    kv_meta], ...]]``; each entry's kv_meta is ``frame[offset : offset + size]``,
    verbatim (any msgpack object)."""
    return _batch_entries("malformed HANDOFF", frame, HEADER_HANDOFF, 2)
