# cython: language_level=3, embedsignature=True
"""The header codec, unrolled by hand over a byte pointer and a length.

The twin of :mod:`coordkit._codec_py`: same functions, byte-identical results,
:class:`~coordkit.protocol.ProtocolError` for the same inputs. The ``ck_*``
functions are the C-level API declared in ``_codec_c.pxd`` for the Cython
coordinator; the Python functions are thin wrappers over them, so the tests
exercise the code the coordinator runs.

Every read goes through the bounds-checked cursor of ``_cursor.h``, and every
length read from the data is checked against the bytes left before it is used.
"""

cimport cython
from cpython.bool cimport PyBool_Check
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_FillInfo, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport (
    PyBytes_AS_STRING,
    PyBytes_CheckExact,
    PyBytes_FromStringAndSize,
    PyBytes_GET_SIZE,
)
from cpython.list cimport PyList_Check, PyList_New, PyList_SET_ITEM
from cpython.long cimport (
    PyLong_AsLongLongAndOverflow,
    PyLong_AsUnsignedLongLong,
    PyLong_Check,
    PyLong_FromLongLong,
    PyLong_FromUnsignedLongLong,
)
from cpython.ref cimport Py_INCREF
from cpython.sequence cimport PySequence_Fast_GET_ITEM, PySequence_Fast_GET_SIZE
from cpython.tuple cimport PyTuple_Check
from libc.stdint cimport (
    INT32_MIN,
    INT64_MAX,
    UINT32_MAX,
    int8_t,
    int16_t,
    int32_t,
    uint16_t,
    uint64_t,
)
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcmp, memcpy, memset

from coordkit._constants cimport (
    HEADER_ENGINE_REPLY,
    HEADER_ENGINE_REPLY_PARTIAL,
    HEADER_REPLY_BATCH,
    HEADER_SUBMIT_BATCH,
    generated_constants,
)

from coordkit._shared import check_constants
from coordkit.protocol import ProtocolError

check_constants(generated_constants())

cdef extern from "_cursor.h" nogil:
    ctypedef struct ck_cursor:
        const uint8_t* p
        const uint8_t* end

    uint16_t ck_load_be16(const uint8_t* p)
    uint32_t ck_load_be32(const uint8_t* p)
    uint64_t ck_load_be64(const uint8_t* p)
    void ck_store_be16(uint8_t* p, uint16_t v)
    void ck_store_be32(uint8_t* p, uint32_t v)
    void ck_store_be64(uint8_t* p, uint64_t v)
    size_t ck_left(const ck_cursor* c)
    const uint8_t* ck_take(ck_cursor* c, size_t n)

cdef extern from "_blake2b.h" nogil:
    ctypedef struct ck_blake2b_state:
        size_t outlen

    enum:
        CK_BLAKE2B_MAX_OUT

    void ck_blake2b_init(ck_blake2b_state* s, size_t outlen)
    void ck_blake2b_update(ck_blake2b_state* s, const uint8_t* data, size_t n)
    void ck_blake2b_update_le32(ck_blake2b_state* s, uint32_t v)
    void ck_blake2b_final(ck_blake2b_state* s, uint8_t* out)

__all__ = [
    "MAX_NESTING",
    "read_header",
    "read_submit",
    "rewrite_submit",
    "write_submit",
    "read_reply",
    "read_header_int",
    "read_submit_batch",
    "read_reply_batch",
    "prompt_tokens",
    "write_header",
    "write_header_int",
    "encode",
    "decode",
    "read_single_head",
    "read_single_submit",
    "read_single_reply",
    "check_prompt",
    "check_map",
    "prompt_hashes",
    "write_single_submit",
    "blake2b",
]

cdef enum:
    _MAX_NESTING = 512
    # msgpack's unpacker refuses a container opened this deep; the skip of
    # read_submit does the same, so it accepts exactly what Unpacker.skip does.
    _SKIP_DEPTH = 1024
    # read_reply takes batches up to this size without a heap allocation.
    _LOCAL_ENTRIES = 64
    _BYTES_PER_TOKEN = 4

#: encode and decode refuse arrays nested deeper than this.
MAX_NESTING = _MAX_NESTING
#: prompt_tokens counts a prompt that is not token ids as this many bytes a token.
BYTES_PER_TOKEN = _BYTES_PER_TOKEN

cdef const char* ck_strstatus(int status) noexcept nogil:
    if status == CK_OK:
        return "ok"
    if status == CK_TRUNCATED:
        return "truncated"
    if status == CK_BAD_TYPE:
        return "unexpected type"
    if status == CK_TRAILING:
        return "trailing bytes"
    if status == CK_RANGE:
        return "int out of int64 range"
    if status == CK_TOO_MANY:
        return "more entries than the buffer holds"
    if status == CK_RID_RANGE:
        return "request id out of range"
    if status == CK_BAD_LENGTH:
        return "array of the wrong length"
    if status == CK_BAD_HEADER:
        return "not an engine reply header"
    if status == CK_RESERVED:
        return "reserved byte 0xc1"
    if status == CK_TOO_DEEP:
        return "nested too deep"
    if status == CK_NOT_MAP:
        return "reply entry is not a map"
    if status == CK_NO_REQUEST_ID:
        return "reply entry has no request_id"
    if status == CK_BAD_REQUEST_ID:
        return "request_id is not an int64"
    if status == CK_PROMPT_STR:
        return "the prompt is a str"
    if status == CK_BAD_TOKEN:
        return "a token is not an int in [0, 2**32)"
    return "unknown status"


# -- reading -----------------------------------------------------------------

cdef inline int _read_array(ck_cursor* c, uint32_t* length) noexcept nogil:
    cdef const uint8_t* p = ck_take(c, 1)
    if p == NULL:
        return CK_TRUNCATED
    cdef uint8_t b = p[0]
    if (b & 0xf0) == 0x90:
        length[0] = b & 0x0f
        return CK_OK
    if b == 0xdc:
        p = ck_take(c, 2)
        if p == NULL:
            return CK_TRUNCATED
        length[0] = ck_load_be16(p)
        return CK_OK
    if b == 0xdd:
        p = ck_take(c, 4)
        if p == NULL:
            return CK_TRUNCATED
        length[0] = ck_load_be32(p)
        return CK_OK
    return CK_BAD_TYPE


cdef inline int _read_int(ck_cursor* c, int64_t* value) noexcept nogil:
    """Any msgpack int. A uint64 above INT64_MAX gives CK_RANGE, with its bits in *value."""
    cdef const uint8_t* p = ck_take(c, 1)
    if p == NULL:
        return CK_TRUNCATED
    cdef uint8_t b = p[0]
    cdef uint64_t u
    if b < 0x80 or b >= 0xe0:
        # positive and negative fixint: the byte is the value as an int8
        value[0] = <int8_t>b
        return CK_OK
    if b < 0xcc or b > 0xd3:
        return CK_BAD_TYPE
    # uint8-64 (0xcc-0xcf) and int8-64 (0xd0-0xd3): the low two bits give the width
    p = ck_take(c, <size_t>1 << (b & 3))
    if p == NULL:
        return CK_TRUNCATED
    if b == 0xcc:
        value[0] = p[0]
    elif b == 0xcd:
        value[0] = ck_load_be16(p)
    elif b == 0xce:
        value[0] = ck_load_be32(p)
    elif b == 0xcf:
        u = ck_load_be64(p)
        value[0] = <int64_t>u
        if u > <uint64_t>INT64_MAX:
            return CK_RANGE
    elif b == 0xd0:
        value[0] = <int8_t>p[0]
    elif b == 0xd1:
        value[0] = <int16_t>ck_load_be16(p)
    elif b == 0xd2:
        value[0] = <int32_t>ck_load_be32(p)
    else:
        value[0] = <int64_t>ck_load_be64(p)
    return CK_OK


# The bytes an object takes, by its first byte, where that fixes them: the
# ints, floats, nil and bools, fixstr and fixext; 0 for the others (containers,
# str, bin and ext with a length, 0xc1).
cdef uint8_t _FIXED_SIZE[256]


cdef void _fill_fixed_sizes() noexcept:
    cdef int b
    for b in range(256):
        if b < 0x80 or b >= 0xe0 or b == 0xc0 or b == 0xc2 or b == 0xc3:
            _FIXED_SIZE[b] = 1                          # fixints, nil, false, true
        elif 0xa0 <= b <= 0xbf:
            _FIXED_SIZE[b] = 1 + (b & 0x1f)             # fixstr
        elif 0xcc <= b <= 0xd3:
            _FIXED_SIZE[b] = 1 + (1 << (b & 3))         # uint8-64, int8-64
        elif b == 0xca or b == 0xcb:
            _FIXED_SIZE[b] = 5 if b == 0xca else 9      # float32, float64
        elif 0xd4 <= b <= 0xd8:
            _FIXED_SIZE[b] = 2 + (1 << (b - 0xd4))      # fixext 1-16, after a type byte
        else:
            _FIXED_SIZE[b] = 0


_fill_fixed_sizes()


cdef int _skip(ck_cursor* c, size_t count) noexcept nogil:
    """Skip `count` whole objects of any type, iteratively.

    pending[d] counts the objects still to skip inside the d-th open
    container (pending[0] those asked for); a container pushes its element
    count, and nothing is ever recursed into. A run of objects of a fixed
    size (a prompt's token ids, most of a map's values) takes one table
    lookup each.
    """
    cdef size_t pending[_SKIP_DEPTH + 1]
    cdef size_t depth = 0
    cdef size_t size            # bytes to jump over (str, bin, ext, float, int)
    cdef size_t width           # bytes of the length before them
    cdef uint64_t elements      # objects in a container (twice the pairs of a map)
    cdef const uint8_t* p
    cdef uint8_t b
    # every object takes at least one byte
    if count > ck_left(c):
        return CK_TRUNCATED
    pending[0] = count
    while True:
        while pending[depth] == 0:
            if depth == 0:
                return CK_OK
            depth -= 1
        p = c.p
        while p != c.end:
            size = _FIXED_SIZE[p[0]]
            if size == 0:
                break
            if <size_t>(c.end - p) < size:
                return CK_TRUNCATED
            p += size
            pending[depth] -= 1
            if pending[depth] == 0:
                break
        c.p = p
        if pending[depth] == 0:
            continue
        # one object of another kind (or none left: truncated)
        pending[depth] -= 1
        p = ck_take(c, 1)
        if p == NULL:
            return CK_TRUNCATED
        b = p[0]
        if b < 0x80 or b >= 0xe0 or b == 0xc0 or b == 0xc2 or b == 0xc3:
            continue
        if b < 0x90:
            elements = 2 * <uint64_t>(b & 0x0f)
        elif b < 0xa0:
            elements = b & 0x0f
        elif b < 0xc0:
            if ck_take(c, b & 0x1f) == NULL:
                return CK_TRUNCATED
            continue
        elif b == 0xc1:
            return CK_RESERVED
        elif b == 0xdc or b == 0xdd or b == 0xde or b == 0xdf:
            p = ck_take(c, 2 if b == 0xdc or b == 0xde else 4)
            if p == NULL:
                return CK_TRUNCATED
            elements = ck_load_be16(p) if b == 0xdc or b == 0xde else ck_load_be32(p)
            if b >= 0xde:
                elements *= 2
        else:
            # the rest: a fixed size, or a big-endian length `width` bytes long
            # followed by that many bytes (and ext's type byte)
            width = 0
            size = 0
            if b == 0xc4 or b == 0xd9:      # bin8, str8
                width = 1
            elif b == 0xc5 or b == 0xda:    # bin16, str16
                width = 2
            elif b == 0xc6 or b == 0xdb:    # bin32, str32
                width = 4
            elif b <= 0xc9:                 # ext8, ext16, ext32
                width = <size_t>1 << (b - 0xc7)
                size = 1
            elif b == 0xca:                 # float32
                size = 4
            elif b == 0xcb:                 # float64
                size = 8
            elif b <= 0xd3:                 # uint8-64, int8-64
                size = <size_t>1 << (b & 3)
            else:                           # fixext 1-16 (0xd4-0xd8), after a type byte
                size = 1 + (<size_t>1 << (b - 0xd4))
            if width:
                p = ck_take(c, width)
                if p == NULL:
                    return CK_TRUNCATED
                size += p[0] if width == 1 else ck_load_be16(p) if width == 2 else ck_load_be32(p)
            if ck_take(c, size) == NULL:
                return CK_TRUNCATED
            continue
        # a container, empty or not, may not open deeper than msgpack's stack
        if depth == _SKIP_DEPTH:
            return CK_TOO_DEEP
        if elements > ck_left(c):
            return CK_TRUNCATED
        if elements:
            depth += 1
            pending[depth] = <size_t>elements


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


cdef int ck_read_header_int(const uint8_t* buf, size_t n, int64_t* header,
                            int64_t* value) noexcept nogil:
    cdef ck_cursor c
    cdef uint32_t length
    c.p = buf
    c.end = buf + n
    cdef int status = _read_array(&c, &length)
    if status != CK_OK:
        return status
    if length != 2:
        return CK_BAD_LENGTH
    status = _read_int(&c, header)
    if status != CK_OK:
        return status
    status = _read_int(&c, value)
    if status != CK_OK:
        return status
    return CK_OK if c.p == c.end else CK_TRAILING


cdef inline int _read_bool(ck_cursor* c, bint* value) noexcept nogil:
    cdef const uint8_t* p = ck_take(c, 1)
    if p == NULL:
        return CK_TRUNCATED
    if p[0] != 0xc2 and p[0] != 0xc3:
        return CK_BAD_TYPE
    value[0] = p[0] == 0xc3
    return CK_OK


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


cdef int ck_read_submit_batch(const uint8_t* buf, size_t n, uint32_t width,
                              ck_batch_entry* entries, uint32_t capacity,
                              uint32_t* count) noexcept nogil:
    cdef ck_cursor c
    cdef uint32_t length, i, fields
    cdef ck_batch_entry entry
    cdef const uint8_t* params
    c.p = buf
    c.end = buf + n
    count[0] = 0
    entry.flag = False
    cdef int status = _read_batch_head(&c, HEADER_SUBMIT_BATCH, &length)
    if status != CK_OK:
        return status
    for i in range(length):
        status = _read_array(&c, &fields)
        if status != CK_OK:
            return status
        if fields != width:
            return CK_BAD_LENGTH
        status = _read_int(&c, &entry.rid)
        if status != CK_OK:
            return CK_RID_RANGE if status == CK_RANGE else status
        _name_entry(entries, capacity, count, i, entry.rid)
        params = c.p
        status = _skip(&c, 1)
        if status != CK_OK:
            return status
        entry.params_offset = <size_t>(params - buf)
        entry.params_size = <size_t>(c.p - params)
        if width == 3:
            status = _read_bool(&c, &entry.flag)
            if status != CK_OK:
                return status
        if i < capacity:
            entries[i] = entry
    if c.p != c.end:
        return CK_TRAILING
    return CK_TOO_MANY if length > capacity else CK_OK


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
    return ck_read_reply_batch(buf, n, entries, capacity, count)


cdef int ck_read_batch_into(const uint8_t* buf, size_t n, int64_t header, uint32_t width,
                            ck_batch_entry** entries, uint32_t* capacity,
                            uint32_t* count) noexcept nogil:
    cdef ck_batch_entry* grown
    cdef int status = _read_batch(buf, n, header, width, entries[0], capacity[0], count)
    if count[0] > capacity[0]:
        grown = <ck_batch_entry*>realloc(entries[0], count[0] * sizeof(ck_batch_entry))
        if grown != NULL:
            entries[0] = grown
            capacity[0] = count[0]
            status = _read_batch(buf, n, header, width, entries[0], capacity[0], count)
    if count[0] > capacity[0]:  # out of memory to grow: name only the entries held
        count[0] = capacity[0]
        return CK_TOO_MANY
    return status


# -- Megatron-Core's single frames -------------------------------------------------

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
    cdef uint32_t length
    out.prompt = 0
    out.params = 0
    cdef int status = _read_array(&c, &length)
    if status != CK_OK:
        return status
    if length != 4:
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
    if status != CK_OK:
        return status
    if c.p != c.end:
        return CK_TRAILING
    return CK_OK


# "request_id" as a msgpack str, in each of its four forms (the header bytes).
cdef inline size_t _request_id_key(const ck_cursor* c) noexcept nogil:
    """The size of the str key at c.p when it is "request_id", else 0; c is not moved."""
    cdef size_t left = ck_left(c)
    cdef const uint8_t* p = c.p
    cdef size_t head
    if left < 11:
        return 0
    if p[0] == 0xaa:
        head = 1
    elif p[0] == 0xd9 and p[1] == 10:
        head = 2
    elif p[0] == 0xda and p[1] == 0 and p[2] == 10:
        head = 3
    elif p[0] == 0xdb and p[1] == 0 and p[2] == 0 and p[3] == 0 and p[4] == 10:
        head = 5
    else:
        return 0
    if left < head + 10 or memcmp(p + head, b"request_id", 10) != 0:
        return 0
    return head + 10


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


cdef int ck_read_single_reply(const uint8_t* buf, size_t n, ck_single_entry* entries,
                              uint32_t capacity, uint32_t* count) noexcept nogil:
    cdef ck_cursor c
    c.p = buf
    c.end = buf + n
    cdef uint32_t length, i
    cdef int64_t header, rid
    cdef int entry_status
    cdef const uint8_t* start
    count[0] = 0
    cdef int status = _read_array(&c, &length)
    if status != CK_OK:
        return status
    if length != 2:
        return CK_BAD_LENGTH
    status = _read_int(&c, &header)
    if status != CK_OK:
        return status
    if header != HEADER_ENGINE_REPLY:
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


# -- writing -----------------------------------------------------------------

cdef inline size_t _write_int(uint8_t* out, int64_t v) noexcept nogil:
    """v in the smallest form, the one msgpack.packb chooses."""
    if v >= 0:
        if v < 0x80:
            out[0] = <uint8_t>v
            return 1
        if v <= 0xff:
            out[0] = 0xcc
            out[1] = <uint8_t>v
            return 2
        if v <= 0xffff:
            out[0] = 0xcd
            ck_store_be16(out + 1, <uint16_t>v)
            return 3
        if v <= UINT32_MAX:
            out[0] = 0xce
            ck_store_be32(out + 1, <uint32_t>v)
            return 5
        out[0] = 0xcf
        ck_store_be64(out + 1, <uint64_t>v)
        return 9
    if v >= -32:
        out[0] = <uint8_t>v     # negative fixint, 0xe0-0xff
        return 1
    if v >= -0x80:
        out[0] = 0xd0
        out[1] = <uint8_t>v
        return 2
    if v >= -0x8000:
        out[0] = 0xd1
        ck_store_be16(out + 1, <uint16_t>v)
        return 3
    if v >= INT32_MIN:
        out[0] = 0xd2
        ck_store_be32(out + 1, <uint32_t>v)
        return 5
    out[0] = 0xd3
    ck_store_be64(out + 1, <uint64_t>v)
    return 9


cdef inline size_t _write_array(uint8_t* out, uint32_t length) noexcept nogil:
    if length < 16:
        out[0] = 0x90 | length
        return 1
    if length <= 0xffff:
        out[0] = 0xdc
        ck_store_be16(out + 1, <uint16_t>length)
        return 3
    out[0] = 0xdd
    ck_store_be32(out + 1, length)
    return 5


cdef inline size_t _write_prefix(uint8_t* out, const ck_submit* prefix, int64_t rid) noexcept nogil:
    cdef size_t n = _write_array(out, prefix.length)
    n += _write_int(out + n, prefix.header)
    return n + _write_int(out + n, rid)


cdef size_t ck_submit_size(const ck_submit* prefix, int64_t rid, size_t rest_len) noexcept nogil:
    # written, not computed, so it cannot drift from what ck_write_submit writes
    cdef uint8_t scratch[CK_SUBMIT_PREFIX_MAX]
    return _write_prefix(scratch, prefix, rid) + rest_len


cdef size_t ck_write_submit(uint8_t* out, const ck_submit* prefix, int64_t rid,
                            const uint8_t* rest, size_t rest_len) noexcept nogil:
    cdef size_t n = _write_prefix(out, prefix, rid)
    memcpy(out + n, rest, rest_len)
    return n + rest_len


cdef size_t ck_write_header_int(uint8_t* out, int64_t header, int64_t value) noexcept nogil:
    out[0] = 0x92
    cdef size_t n = 1 + _write_int(out + 1, header)
    return n + _write_int(out + n, value)


cdef size_t ck_write_header(uint8_t* out, int64_t header) noexcept nogil:
    out[0] = 0x91
    return 1 + _write_int(out + 1, header)


cdef size_t ck_write_batch_head(uint8_t* out, int64_t header, uint32_t count) noexcept nogil:
    out[0] = 0x92
    cdef size_t n = 1 + _write_int(out + 1, header)
    return n + ck_write_array(out + n, count)


cdef inline size_t _write_single_prefix(uint8_t* out, int64_t header, int64_t rid) noexcept nogil:
    out[0] = 0x94
    cdef size_t n = 1 + _write_int(out + 1, header)
    return n + _write_int(out + n, rid)


cdef size_t ck_single_submit_size(int64_t header, int64_t rid, size_t prompt_len,
                                  size_t params_len) noexcept nogil:
    cdef uint8_t scratch[CK_SINGLE_PREFIX_MAX]
    return _write_single_prefix(scratch, header, rid) + prompt_len + params_len


cdef size_t ck_write_single_submit(uint8_t* out, int64_t header, int64_t rid,
                                   const uint8_t* prompt, size_t prompt_len,
                                   const uint8_t* params, size_t params_len) noexcept nogil:
    cdef size_t n = _write_single_prefix(out, header, rid)
    memcpy(out + n, prompt, prompt_len)
    memcpy(out + n + prompt_len, params, params_len)
    return n + prompt_len + params_len


cdef size_t ck_write_int(uint8_t* out, int64_t v) noexcept nogil:
    return _write_int(out, v)


cdef size_t ck_write_uint(uint8_t* out, uint64_t v) noexcept nogil:
    if v <= <uint64_t>INT64_MAX:
        return _write_int(out, <int64_t>v)
    out[0] = 0xcf
    ck_store_be64(out + 1, v)
    return 9


cdef size_t ck_write_array(uint8_t* out, uint32_t length) noexcept nogil:
    return _write_array(out, length)


# -- the Python API ----------------------------------------------------------

cdef inline int _acquire(object frame, Py_buffer* view) except -1:
    # bytes, the common case, skips the lookup of its buffer slot
    if PyBytes_CheckExact(frame):
        return PyBuffer_FillInfo(
            view, frame, PyBytes_AS_STRING(frame), PyBytes_GET_SIZE(frame), 1, PyBUF_SIMPLE
        )
    return PyObject_GetBuffer(frame, view, PyBUF_SIMPLE)


cdef object _error(str what, int status, object rid=None):
    return ProtocolError(f"{what}: {ck_strstatus(status).decode()}", rid)


cdef inline int64_t _int64_arg(object value) except? -1:
    # stricter than Cython's own int64_t conversion, which truncates floats
    cdef int overflow
    if not PyLong_Check(value) or PyBool_Check(value):
        raise TypeError(f"expected an int, got {type(value).__name__}")
    cdef long long v = PyLong_AsLongLongAndOverflow(value, &overflow)
    if overflow:
        raise OverflowError(f"{value} does not fit int64")
    return v


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


def rewrite_submit(frame, rid) -> bytes:
    """``frame``, validated as by read_submit, with its request id replaced by ``rid``."""
    cdef int64_t new_rid = _int64_arg(rid)
    cdef Py_buffer view
    cdef ck_submit s
    _acquire(frame, &view)
    cdef const uint8_t* buf = <const uint8_t*>view.buf
    cdef int status = ck_read_submit(buf, view.len, &s)
    if status != CK_OK:
        PyBuffer_Release(&view)
        raise _error("malformed metadata frame", status, s.rid if s.offset else None)
    cdef size_t rest_len = view.len - s.offset
    try:
        out = PyBytes_FromStringAndSize(NULL, ck_submit_size(&s, new_rid, rest_len))
        ck_write_submit(<uint8_t*>PyBytes_AS_STRING(out), &s, new_rid, buf + s.offset, rest_len)
    finally:
        PyBuffer_Release(&view)
    return out


def write_submit(header, length, rid, rest) -> bytes:
    """``[header, rid, <rest>]``, an array of ``length`` elements: ``rest`` (the
    other ``length - 2``, already packed) spliced in as it is."""
    cdef ck_submit prefix
    cdef int64_t r = _int64_arg(rid)
    cdef Py_buffer view
    prefix.header = _int64_arg(header)
    if not PyLong_Check(length) or PyBool_Check(length):
        raise TypeError(f"expected an int, got {type(length).__name__}")
    if not 2 <= length <= 0xFFFFFFFF:
        raise ValueError(f"length must be in 2..2**32-1, not {length}")
    prefix.length = length
    _acquire(rest, &view)
    try:
        out = PyBytes_FromStringAndSize(NULL, ck_submit_size(&prefix, r, view.len))
        ck_write_submit(
            <uint8_t*>PyBytes_AS_STRING(out), &prefix, r, <const uint8_t*>view.buf, view.len
        )
    finally:
        PyBuffer_Release(&view)
    return out


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
        if header == HEADER_SUBMIT_BATCH:
            return [
                (entries[i].rid, entries[i].params_offset, entries[i].params_size,
                 entries[i].flag)
                for i in range(count)
            ]
        return [(entries[i].rid, entries[i].flag) for i in range(count)]
    finally:
        PyBuffer_Release(&view)
        free(entries)


def read_submit_batch(frame, width=3) -> list[tuple[int, int, int, bool]]:
    """``[(rid, params_offset, params_size, hashed), ...]`` of a SUBMIT_BATCH.

    ``width`` 3: a client's ``[95, [[rid, params, hashed], ...]]``; 2: the
    coordinator's to an engine, ``[95, [[rid, params], ...]]`` (hashed False).
    Each entry's sampling params are ``frame[offset : offset + size]``, verbatim.
    """
    if width != 2 and width != 3:
        raise ValueError(f"width must be 2 or 3, not {width!r}")
    return _batch_entries("malformed SUBMIT_BATCH", frame, HEADER_SUBMIT_BATCH, width)


def read_reply_batch(frame) -> list[tuple[int, bool]]:
    """``[(rid, final), ...]`` of a REPLY_BATCH ``[96, [[rid, final], ...]]``."""
    return _batch_entries("malformed REPLY_BATCH", frame, HEADER_REPLY_BATCH, 2)


def write_header(header) -> bytes:
    """``msgpack.packb([header])``."""
    cdef uint8_t out[CK_HEADER_MAX]
    cdef size_t n = ck_write_header(out, _int64_arg(header))
    return PyBytes_FromStringAndSize(<char*>out, n)


def write_header_int(header, value) -> bytes:
    """``msgpack.packb([header, value])``."""
    cdef uint8_t out[CK_HEADER_INT_MAX]
    cdef size_t n = ck_write_header_int(out, _int64_arg(header), _int64_arg(value))
    return PyBytes_FromStringAndSize(<char*>out, n)


# -- the Python API: Megatron-Core's single frames -----------------------------

def read_single_submit(frame) -> tuple[int, int, int, int]:
    """``(header, rid, prompt, params)`` of a single-frame SUBMIT
    ``[header, rid, prompt, sampling_params]``, validated whole.

    ``frame[prompt:params]`` is the prompt (a msgpack str or array) and
    ``frame[params:]`` the sampling params (a map), both checked for structure
    only. A fault after the rid raises ProtocolError with ``rid`` set.
    """
    cdef Py_buffer view
    cdef ck_single_submit s
    _acquire(frame, &view)
    cdef int status = ck_read_single_submit(<const uint8_t*>view.buf, view.len, &s)
    PyBuffer_Release(&view)
    if status != CK_OK:
        raise _error("malformed metadata frame", status, s.rid if s.prompt else None)
    return s.header, s.rid, s.prompt, s.params


def read_single_head(frame) -> tuple[int, int, int]:
    """``(header, rid, prompt)`` of a single-frame SUBMIT ``[header, rid, ...]``,
    read as far as its rid: an array of 4, int64 header and rid. Nothing after
    the rid is read: ``frame[prompt:]`` is the prompt and the params, unchecked."""
    cdef Py_buffer view
    cdef ck_single_submit s
    _acquire(frame, &view)
    cdef int status = ck_read_single_head(<const uint8_t*>view.buf, view.len, &s)
    PyBuffer_Release(&view)
    if status != CK_OK:
        raise _error("malformed metadata frame", status)
    return s.header, s.rid, s.prompt


def read_single_reply(frame) -> list[tuple[int, int, int | None, str | None]]:
    """The entries of a single-frame ENGINE_REPLY ``[21, [map, ...]]``.

    One ``(start, end, rid, error)`` per entry: ``frame[start:end]`` is its
    bytes, ``rid`` its top-level ``"request_id"``, or None with ``error``
    saying why (not a map, no request_id, a request_id that is not an int64).
    A frame that is not valid as a whole raises ProtocolError.
    """
    cdef Py_buffer view
    cdef ck_single_entry local[_LOCAL_ENTRIES]
    cdef ck_single_entry* entries = local
    cdef uint32_t count, i
    _acquire(frame, &view)
    cdef const uint8_t* buf = <const uint8_t*>view.buf
    cdef int status = ck_read_single_reply(buf, view.len, local, _LOCAL_ENTRIES, &count)
    if status == CK_TOO_MANY:
        entries = <ck_single_entry*>malloc(count * sizeof(ck_single_entry))
        if entries == NULL:
            PyBuffer_Release(&view)
            raise MemoryError()
        status = ck_read_single_reply(buf, view.len, entries, count, &count)
    PyBuffer_Release(&view)
    try:
        if status != CK_OK:
            raise _error("malformed engine reply", status)
        return [
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


def write_single_submit(header, rid, prompt, params) -> bytes:
    """``[header, rid, <prompt>, <params>]``: the two byte strings spliced in as
    they are (so ``msgpack.packb([header, rid, p, s])`` when they are ``packb(p)``
    and ``packb(s)``)."""
    cdef int64_t h = _int64_arg(header)
    cdef int64_t r = _int64_arg(rid)
    cdef Py_buffer pv, sv
    _acquire(prompt, &pv)
    try:
        _acquire(params, &sv)
    except BaseException:
        PyBuffer_Release(&pv)
        raise
    try:
        out = PyBytes_FromStringAndSize(NULL, ck_single_submit_size(h, r, pv.len, sv.len))
        ck_write_single_submit(
            <uint8_t*>PyBytes_AS_STRING(out),
            h,
            r,
            <const uint8_t*>pv.buf,
            pv.len,
            <const uint8_t*>sv.buf,
            sv.len,
        )
    finally:
        PyBuffer_Release(&pv)
        PyBuffer_Release(&sv)
    return out


def blake2b(data, digest_size=8) -> bytes:
    """``hashlib.blake2b(data, digest_size=digest_size).digest()``, by ``_blake2b.h``
    (the block hashes' BLAKE2b, exposed so that it can be tested on its own)."""
    if not 1 <= digest_size <= CK_BLAKE2B_MAX_OUT:
        raise ValueError(f"digest_size must be in 1..{CK_BLAKE2B_MAX_OUT}")
    cdef ck_blake2b_state state
    cdef uint8_t digest[CK_BLAKE2B_MAX_OUT]
    cdef Py_buffer view
    _acquire(data, &view)
    ck_blake2b_init(&state, digest_size)
    ck_blake2b_update(&state, <const uint8_t*>view.buf, view.len)
    PyBuffer_Release(&view)
    ck_blake2b_final(&state, digest)
    return PyBytes_FromStringAndSize(<char*>digest, digest_size)


# -- encode and decode: None, bool, int and arrays of them --------------------

cdef struct _Writer:
    uint8_t* buf
    size_t len
    size_t cap
    uint8_t local[256]


cdef int _grow(_Writer* w, size_t need) except -1:
    cdef size_t cap = max(2 * w.cap, w.len + need)
    cdef uint8_t* buf
    if w.buf == w.local:
        buf = <uint8_t*>malloc(cap)
        if buf != NULL:
            memcpy(buf, w.local, w.len)
    else:
        buf = <uint8_t*>realloc(w.buf, cap)
    if buf == NULL:
        raise MemoryError()
    w.buf = buf
    w.cap = cap
    return 0


cdef int _encode(_Writer* w, object obj, int level) except -1:
    cdef int overflow
    cdef long long v
    cdef Py_ssize_t i, size
    # the largest single write: a uint64 or an array32 header
    if w.cap - w.len < 9:
        _grow(w, 9)
    cdef uint8_t* out = w.buf + w.len
    if obj is None:
        out[0] = 0xc0
        w.len += 1
    elif obj is True:
        out[0] = 0xc3
        w.len += 1
    elif obj is False:
        out[0] = 0xc2
        w.len += 1
    elif PyLong_Check(obj):
        v = PyLong_AsLongLongAndOverflow(obj, &overflow)
        if overflow == 0:
            w.len += _write_int(out, v)
        elif overflow > 0:
            try:
                out[0] = 0xcf
                ck_store_be64(out + 1, PyLong_AsUnsignedLongLong(obj))
            except OverflowError:
                raise ProtocolError(f"encode: {obj} is out of range") from None
            w.len += 9
        else:
            raise ProtocolError(f"encode: {obj} is out of range")
    elif PyList_Check(obj) or PyTuple_Check(obj):
        if level >= _MAX_NESTING:
            raise ProtocolError("encode: nested too deep")
        size = PySequence_Fast_GET_SIZE(obj)
        if size > UINT32_MAX:
            raise ProtocolError("encode: array too long")
        w.len += _write_array(out, <uint32_t>size)
        # no Python code runs below (int subclasses convert without calls),
        # so the sequence cannot change size under the loop
        for i in range(size):
            _encode(w, <object>PySequence_Fast_GET_ITEM(obj, i), level + 1)
    else:
        raise ProtocolError(f"encode: unsupported type {type(obj).__name__}")
    return 0


def encode(obj) -> bytes:
    """``msgpack.packb(obj)`` for None, bool, int (-2**63 .. 2**64-1) and lists
    or tuples of them, nested at most MAX_NESTING deep; ProtocolError otherwise."""
    cdef _Writer w
    w.buf = w.local
    w.len = 0
    w.cap = sizeof(w.local)
    try:
        _encode(&w, obj, 0)
        return PyBytes_FromStringAndSize(<char*>w.buf, w.len)
    finally:
        if w.buf != w.local:
            free(w.buf)


cdef object _decode(ck_cursor* c, int level):
    cdef int64_t v
    cdef uint32_t length, i
    cdef int status
    if ck_left(c) == 0:
        raise _error("decode", CK_TRUNCATED)
    cdef uint8_t b = c.p[0]
    if b == 0xc0 or b == 0xc2 or b == 0xc3:
        c.p += 1
        return None if b == 0xc0 else b == 0xc3
    if (b & 0xf0) == 0x90 or b == 0xdc or b == 0xdd:
        status = _read_array(c, &length)
        if status == CK_OK and level >= _MAX_NESTING:
            status = CK_TOO_DEEP
        # every element takes at least one byte: no list larger than the frame
        if status == CK_OK and length > ck_left(c):
            status = CK_TRUNCATED
        if status != CK_OK:
            raise _error("decode", status)
        result = PyList_New(length)
        for i in range(length):
            item = _decode(c, level + 1)
            Py_INCREF(item)
            PyList_SET_ITEM(result, i, item)
        return result
    status = _read_int(c, &v)
    if status == CK_OK:
        return PyLong_FromLongLong(v)
    if status == CK_RANGE:
        return PyLong_FromUnsignedLongLong(<uint64_t>v)
    raise _error("decode", status)


def decode(frame) -> object:
    """``msgpack.unpackb(frame)`` for the types encode writes; ProtocolError for
    anything else, for trailing bytes and for arrays nested deeper than MAX_NESTING."""
    cdef Py_buffer view
    cdef ck_cursor c
    _acquire(frame, &view)
    c.p = <const uint8_t*>view.buf
    c.end = c.p + view.len
    try:
        result = _decode(&c, 0)
        if c.p != c.end:
            raise _error("decode", CK_TRAILING)
        return result
    finally:
        PyBuffer_Release(&view)
