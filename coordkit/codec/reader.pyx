"""The reads every part of the codec is made of (included by _codec_c.pyx).

The status texts; an array head, an int, a bool and the structural skip of
any object, each at a cursor (``includes/cursor.h``), returning a
``ck_status`` and never reading past the cursor's end, whatever the lengths in
the data say; and the helpers the parts' Python functions share.
"""

from cpython.bool cimport PyBool_Check
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_FillInfo, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_CheckExact, PyBytes_GET_SIZE
from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_Check
from libc.stdint cimport INT64_MAX, int8_t, int16_t, int32_t, int64_t, uint8_t, uint32_t, uint64_t

from .includes.cursor cimport ck_cursor, ck_left, ck_load_be16, ck_load_be32, ck_load_be64, ck_take

from .protocol import ProtocolError

cdef enum:
    # msgpack's unpacker refuses a container opened this deep; the skip of
    # read_submit does the same, so it accepts exactly what Unpacker.skip does.
    _SKIP_DEPTH = 1024
    # read_reply takes batches up to this size without a heap allocation.
    _LOCAL_ENTRIES = 64

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
    if status == CK_QOS_RANGE:
        return "priority or deadline out of range"
    return "unknown status"


# -- reads at a cursor ----------------------------------------------------------

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


cdef inline int _read_bool(ck_cursor* c, bint* value) noexcept nogil:
    cdef const uint8_t* p = ck_take(c, 1)
    if p == NULL:
        return CK_TRUNCATED
    if p[0] != 0xc2 and p[0] != 0xc3:
        return CK_BAD_TYPE
    value[0] = p[0] == 0xc3
    return CK_OK


cdef int ck_read_array(ck_cursor* c, uint32_t* length) noexcept nogil:
    return _read_array(c, length)


cdef int ck_read_int(ck_cursor* c, int64_t* value) noexcept nogil:
    return _read_int(c, value)


# -- the Python API's helpers ---------------------------------------------------

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
