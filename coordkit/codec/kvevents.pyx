"""The engines' KV-event batches read into the index's records (included by _codec_c.pyx;
the thread's half of the index, which chains their hashes, is kvchains.pyx).

``decode_kv_batch`` is ``coordkit._kvevents.decode_batch`` (its twin,
``_codec_py.decode_kv_batch``, is that function) read in C without the GIL, so
that the events' thread neither builds a Python object per token id nor holds
the GIL the loop takes between two messages. It reads a batch only when every
part of it is in the shapes the Python reader takes without a doubt: valid
msgpack with valid UTF-8 strs, no ext type, no array or map as a map key,
nesting within _KV_DEPTH, and no event the Python reader would count as
malformed. Any other batch goes to the Python reader, whose answer is then the
same by construction (the tests compare both on the same batches).
"""

from cpython.buffer cimport PyBuffer_Release
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcmp, memset, strlen

from .includes.sysdep cimport ck_load_le64, ck_store_le64

from ._kvevents import Filter as _Filter
from ._kvevents import decode_batch as _decode_batch_py

cdef enum:
    _KV_DEPTH = 64          # deeper: the Python reader's
    _KV_PYTHON = 1          # a status: the batch is the Python reader's
    _KV_NO_MEMORY = 2
    _KV_MAX_MEDIA = 8       # a filter with more: the Python reader's
    # the fields of an event, in BlockStored's array order (_kvevents.STORED_FIELDS)
    _F_HASHES = 0
    _F_PARENT = 1
    _F_TOKENS = 2
    _F_SIZE = 3
    _F_LORA_ID = 4
    _F_MEDIUM = 5
    _F_LORA_NAME = 6
    _F_EXTRA = 7
    _F_GROUP = 8
    _F_TYPE = 9
    _F_COUNT = 10
    # the records (_kvevents.HEAD, STORE, REMOVE)
    _OP_CLEAR = 0
    _OP_STORE = 1
    _OP_REMOVE = 2
    _OP_HASHED = 4
    _STORE_HEAD = 22
    _REMOVE_HEAD = 9
    _CLEAR_SIZE = 5

# The map keys of an event's fields, by field (a map event's).
cdef const char* _FIELD_NAMES[_F_COUNT]
_FIELD_NAMES[:] = [
    b"block_hashes", b"parent_block_hash", b"token_ids", b"block_size", b"lora_id",
    b"medium", b"lora_name", b"extra_keys", b"group_idx", b"type",
]
# A uint8, 16 or 32's value: the 4 bytes after its first, shifted (by its first & 3).
cdef uint8_t _TOKEN_SHIFT[4]
_TOKEN_SHIFT[:] = [24, 16, 0, 0]
# BlockRemoved's fields by array position (_kvevents.REMOVED_FIELDS).
cdef int _REMOVED_ORDER[3]
_REMOVED_ORDER[:] = [_F_HASHES, _F_MEDIUM, _F_GROUP]


ctypedef struct _kv_filter:
    uint64_t block_size
    uint32_t rank
    int n_media
    const uint8_t* media[_KV_MAX_MEDIA]
    size_t media_size[_KV_MAX_MEDIA]
    int n_groups
    int64_t groups[_KV_MAX_MEDIA]


ctypedef struct _kv_out:
    uint8_t* data   # the records, one after another
    size_t size
    size_t cap
    size_t* ends    # where each ends
    size_t n
    size_t ends_cap


cdef inline bint _kv_utf8(const uint8_t* s, size_t n) noexcept nogil:
    """Whether ``s`` is UTF-8 that Python's strict decoder takes (no surrogate, no
    overlong form, nothing past U+10FFFF)."""
    cdef size_t i = 0, j, k
    cdef uint8_t b, lo, hi
    while i < n:
        b = s[i]
        if b < 0x80:
            i += 1
            continue
        lo, hi = 0x80, 0xbf
        if 0xc2 <= b <= 0xdf:
            k = 1
        elif 0xe0 <= b <= 0xef:
            k = 2
            if b == 0xe0:
                lo = 0xa0
            elif b == 0xed:
                hi = 0x9f
        elif 0xf0 <= b <= 0xf4:
            k = 3
            if b == 0xf0:
                lo = 0x90
            elif b == 0xf4:
                hi = 0x8f
        else:
            return False
        if n - i <= k or not lo <= s[i + 1] <= hi:
            return False
        for j in range(2, k + 1):
            if (s[i + j] & 0xc0) != 0x80:
                return False
        i += k + 1
    return True


cdef inline bint _kv_is_container(uint8_t b) noexcept nogil:
    return (0x80 <= b <= 0x9f) or 0xdc <= b <= 0xdf


cdef int _kv_valid(ck_cursor* c, int depth) noexcept nogil:
    """Past one object that msgpack.unpackb(raw=False, strict_map_key=False) builds as
    this module expects; _KV_PYTHON for any other."""
    cdef const uint8_t* p = ck_take(c, 1)
    cdef uint8_t b
    cdef size_t size, width = 0
    cdef uint64_t elements, _e
    cdef bint is_map
    if p == NULL or depth > _KV_DEPTH:
        return _KV_PYTHON
    b = p[0]
    if b < 0x80 or b >= 0xe0 or b == 0xc0 or b == 0xc2 or b == 0xc3:
        return CK_OK
    if 0xcc <= b <= 0xd3 or b == 0xca or b == 0xcb:  # ints, floats
        size = (<size_t>1 << (b & 3)) if b >= 0xcc else (4 if b == 0xca else 8)
        return CK_OK if ck_take(c, size) != NULL else _KV_PYTHON
    if 0xa0 <= b <= 0xbf or b == 0xd9 or b == 0xda or b == 0xdb:  # str
        if b <= 0xbf:
            size = b & 0x1f
        else:
            width = <size_t>1 << (b - 0xd9)
            p = ck_take(c, width)
            if p == NULL:
                return _KV_PYTHON
            size = p[0] if width == 1 else ck_load_be16(p) if width == 2 else ck_load_be32(p)
        p = ck_take(c, size)
        return CK_OK if p != NULL and _kv_utf8(p, size) else _KV_PYTHON
    if b == 0xc4 or b == 0xc5 or b == 0xc6:  # bin
        width = <size_t>1 << (b - 0xc4)
        p = ck_take(c, width)
        if p == NULL:
            return _KV_PYTHON
        size = p[0] if width == 1 else ck_load_be16(p) if width == 2 else ck_load_be32(p)
        return CK_OK if ck_take(c, size) != NULL else _KV_PYTHON
    if not _kv_is_container(b):
        return _KV_PYTHON  # ext, fixext, 0xc1
    is_map = b < 0x90 or b >= 0xde
    if b < 0xa0:
        elements = b & 0x0f
    else:
        p = ck_take(c, 2 if b == 0xdc or b == 0xde else 4)
        if p == NULL:
            return _KV_PYTHON
        elements = ck_load_be16(p) if b == 0xdc or b == 0xde else ck_load_be32(p)
    for _e in range(elements):
        if is_map:
            if ck_left(c) == 0 or _kv_is_container(c.p[0]):
                return _KV_PYTHON
            if _kv_valid(c, depth + 1) != CK_OK:
                return _KV_PYTHON
        # the common case: a run of ints (token ids, block hashes), inline; their sizes
        # from a table, not a branch on their form (missed half the time on token ids)
        if ck_left(c) and (c.p[0] < 0x80 or 0xcc <= c.p[0] <= 0xd3):
            if ck_take(c, _FIXED_SIZE[c.p[0]]) == NULL:
                return _KV_PYTHON
        elif _kv_valid(c, depth + 1) != CK_OK:
            return _KV_PYTHON
    return CK_OK


cdef inline bint _kv_at(const uint8_t* p, const uint8_t* end, ck_cursor* c) noexcept nogil:
    """A cursor at a field (False: absent)."""
    if p == NULL:
        return False
    c.p = p
    c.end = end
    return True


cdef inline bint _kv_nil(const uint8_t* p) noexcept nogil:
    return p == NULL or p[0] == 0xc0


cdef inline int _kv_str(ck_cursor* c, const uint8_t** s, size_t* n) noexcept nogil:
    """A str (checked before: _kv_valid), or _KV_PYTHON with the cursor unmoved."""
    cdef const uint8_t* p
    cdef uint8_t b = c.p[0]
    cdef size_t width
    if not (0xa0 <= b <= 0xbf or b == 0xd9 or b == 0xda or b == 0xdb):
        return _KV_PYTHON
    c.p += 1
    if 0xa0 <= b <= 0xbf:
        n[0] = b & 0x1f
    elif b == 0xd9 or b == 0xda or b == 0xdb:
        width = <size_t>1 << (b - 0xd9)
        p = ck_take(c, width)
        n[0] = p[0] if width == 1 else ck_load_be16(p) if width == 2 else ck_load_be32(p)
    s[0] = ck_take(c, n[0])
    return CK_OK


cdef inline bint _kv_is(const uint8_t* s, size_t n, const char* name) noexcept nogil:
    return n == strlen(name) and memcmp(s, name, n) == 0


cdef inline int _kv_key(ck_cursor* c, uint64_t* key) noexcept nogil:
    """An engine's block hash as a key (_kvevents.key_of): an int's value modulo 2**64,
    the first 8 bytes of the BLAKE2b of bytes; _KV_PYTHON for another type."""
    cdef int64_t value
    cdef int status
    cdef uint8_t b = c.p[0]
    cdef const uint8_t* p
    cdef size_t width, size
    cdef ck_blake2b_state state
    cdef uint8_t digest[8]
    if b == 0xc4 or b == 0xc5 or b == 0xc6:
        c.p += 1
        width = <size_t>1 << (b - 0xc4)
        p = ck_take(c, width)
        size = p[0] if width == 1 else ck_load_be16(p) if width == 2 else ck_load_be32(p)
        p = ck_take(c, size)
        ck_blake2b_init(&state, 8)
        ck_blake2b_update(&state, p, size)
        ck_blake2b_final(&state, digest)
        key[0] = ck_load_le64(digest)
        return CK_OK
    status = _read_int(c, &value)
    if status != CK_OK and status != CK_RANGE:
        return _KV_PYTHON  # a bool, a str, a float, nil, a container
    key[0] = <uint64_t>value
    return CK_OK


cdef inline int _kv_room(_kv_out* out, size_t extra) noexcept nogil:
    cdef size_t cap
    cdef uint8_t* data
    cdef size_t* ends
    if out.size + extra > out.cap:
        cap = max(2 * out.cap, out.size + extra)
        data = <uint8_t*>realloc(out.data, cap)
        if data == NULL:
            return _KV_NO_MEMORY
        out.data, out.cap = data, cap
    if out.n == out.ends_cap:
        cap = max(2 * out.ends_cap, <size_t>16)
        ends = <size_t*>realloc(out.ends, cap * sizeof(size_t))
        if ends == NULL:
            return _KV_NO_MEMORY
        out.ends, out.ends_cap = ends, cap
    return CK_OK


cdef inline void _kv_le32(uint8_t* p, uint32_t v) noexcept nogil:
    p[0] = <uint8_t>v
    p[1] = <uint8_t>(v >> 8)
    p[2] = <uint8_t>(v >> 16)
    p[3] = <uint8_t>(v >> 24)


cdef inline uint8_t* _kv_record(_kv_out* out, size_t size, uint8_t op,
                                const _kv_filter* f) noexcept nogil:
    """Room for a record of ``size`` bytes, its op and rank written; NULL: memory short."""
    cdef uint8_t* p
    if _kv_room(out, size) != CK_OK:
        return NULL
    p = out.data + out.size
    out.size += size
    out.ends[out.n] = out.size
    out.n += 1
    p[0] = op
    _kv_le32(p + 1, f.rank)
    return p


cdef inline int _kv_token(ck_cursor* c, uint8_t* out) noexcept nogil:
    """A token id, an int in [0, 2**32), stored LE at ``out``; _KV_PYTHON for another."""
    cdef const uint8_t* p = c.p
    cdef uint8_t b
    cdef int64_t value
    if c.end - p >= 5:
        b = p[0]
        if b < 0x80 or 0xcc <= b <= 0xce:  # a fixint, a uint8, 16 or 32: no branch on which
            _kv_le32(out, b if b < 0x80 else ck_load_be32(p + 1) >> _TOKEN_SHIFT[b & 3])
            c.p = p + _FIXED_SIZE[b]
            return CK_OK
    if _read_int(c, &value) != CK_OK or value < 0 or value > <int64_t>0xffffffff:
        return _KV_PYTHON
    _kv_le32(out, <uint32_t>value)
    return CK_OK


cdef int _kv_counts(const uint8_t* medium, const uint8_t* group, const uint8_t* end,
                    const _kv_filter* f, bint* counts) noexcept nogil:
    """_kvevents.Filter.counts."""
    cdef ck_cursor c
    cdef const uint8_t* s
    cdef size_t n
    cdef int64_t value = 0
    cdef int i
    counts[0] = False
    if not _kv_nil(group):
        if group[0] == 0xc2 or group[0] == 0xc3:
            value = group[0] == 0xc3
        else:
            _kv_at(group, end, &c)
            if _read_int(&c, &value) != CK_OK:
                return _KV_PYTHON  # ("" or 0) is 0, ([] or 0) too: the Python reader's
    for i in range(f.n_groups):
        if f.groups[i] == value:
            break
    else:
        return CK_OK
    if _kv_nil(medium):
        counts[0] = True
        return CK_OK
    _kv_at(medium, end, &c)
    if _kv_str(&c, &s, &n) != CK_OK:
        return CK_OK  # not a str: in no tuple of strs
    for i in range(f.n_media):
        if n == f.media_size[i] and memcmp(s, f.media[i], n) == 0:
            counts[0] = True
    return CK_OK


cdef int _kv_keys(ck_cursor* c, uint32_t* n, uint64_t** keys) noexcept nogil:
    """An array of block hashes as keys (malloc'd, the caller frees; NULL when empty)."""
    cdef uint32_t i
    keys[0] = NULL
    if _read_array(c, n) != CK_OK:
        return _KV_PYTHON
    if n[0] == 0:
        return CK_OK
    keys[0] = <uint64_t*>malloc(n[0] * sizeof(uint64_t))
    if keys[0] == NULL:
        return _KV_NO_MEMORY
    for i in range(n[0]):
        if _kv_key(c, &keys[0][i]) != CK_OK:
            return _KV_PYTHON
    return CK_OK


cdef int _kv_stored(const uint8_t** fields, const uint8_t* end, const _kv_filter* f,
                    _kv_out* out) noexcept nogil:
    """_kvevents._store: its record, or none."""
    cdef ck_cursor c, tokens
    cdef uint32_t n_keys = 0, n_tokens, n, i, m
    cdef uint64_t* keys = NULL
    cdef uint64_t parent = 0
    cdef int64_t size = 0
    cdef int status
    cdef bint counts
    cdef uint8_t* p
    if not _kv_at(fields[_F_TOKENS], end, &tokens) or _read_array(&tokens, &n_tokens) != CK_OK:
        return _KV_PYTHON
    if not _kv_at(fields[_F_SIZE], end, &c) or _read_int(&c, &size) != CK_OK or size < 1:
        return _KV_PYTHON
    if not _kv_at(fields[_F_HASHES], end, &c):
        return _KV_PYTHON
    status = _kv_keys(&c, &n_keys, &keys)
    if status == CK_OK and not _kv_nil(fields[_F_PARENT]):
        _kv_at(fields[_F_PARENT], end, &c)
        status = _kv_key(&c, &parent)
    if status == CK_OK and (
        (n_keys == 0 and n_tokens != 0) or (n_keys and (<uint64_t>size > n_tokens
                                                        or <uint64_t>size * n_keys != n_tokens))
    ):
        status = _KV_PYTHON
    if status == CK_OK:
        status = _kv_counts(fields[_F_MEDIUM], fields[_F_GROUP], end, f, &counts)
    n = n_keys
    if status != CK_OK or not counts or <uint64_t>size != f.block_size:
        free(keys)
        return status
    if not _kv_nil(fields[_F_LORA_ID]) or not _kv_nil(fields[_F_LORA_NAME]):
        free(keys)
        return CK_OK  # a LoRA's blocks: coordkit's hashes are the base model's
    if _kv_at(fields[_F_EXTRA], end, &c) and _read_array(&c, &m) == CK_OK:
        # the blocks before the first with extra keys (media, salt)
        for i in range(m):
            if c.p[0] != 0xc0:
                n = min(n, i)
                break
            c.p += 1
    if n == 0:
        free(keys)
        return CK_OK
    p = _kv_record(out, _STORE_HEAD + (8 + 4 * <size_t>size) * n, _OP_STORE, f)
    if p == NULL:
        free(keys)
        return _KV_NO_MEMORY
    p[5] = not _kv_nil(fields[_F_PARENT])
    ck_store_le64(p + 6, parent)
    _kv_le32(p + 14, n)
    _kv_le32(p + 18, <uint32_t>size)
    p += _STORE_HEAD
    for i in range(n):
        ck_store_le64(p + 8 * <size_t>i, keys[i])
    free(keys)
    p += 8 * <size_t>n
    for i in range(n * <uint32_t>size):
        if _kv_token(&tokens, p + 4 * <size_t>i) != CK_OK:
            return _KV_PYTHON  # not a u32: the Python reader counts it
    return CK_OK


cdef int _kv_removed(const uint8_t** fields, const uint8_t* end, const _kv_filter* f,
                     _kv_out* out) noexcept nogil:
    cdef ck_cursor c
    cdef uint32_t n, i
    cdef uint64_t* keys = NULL
    cdef bint counts = False
    cdef int status
    cdef uint8_t* p
    if not _kv_at(fields[_F_HASHES], end, &c):
        return _KV_PYTHON
    status = _kv_keys(&c, &n, &keys)
    if status == CK_OK and n:
        status = _kv_counts(fields[_F_MEDIUM], fields[_F_GROUP], end, f, &counts)
    if status == CK_OK and counts:
        p = _kv_record(out, _REMOVE_HEAD + 8 * <size_t>n, _OP_REMOVE, f)
        if p == NULL:
            status = _KV_NO_MEMORY
        else:
            _kv_le32(p + 5, n)
            for i in range(n):
                ck_store_le64(p + _REMOVE_HEAD + 8 * <size_t>i, keys[i])
    free(keys)
    return status


cdef inline int _kv_head(ck_cursor* c, uint32_t* length, bint* is_map) noexcept nogil:
    """An array's or a map's head (its pairs); _KV_PYTHON for another object."""
    cdef const uint8_t* p
    cdef uint8_t b
    if ck_left(c) == 0 or not _kv_is_container(c.p[0]):
        return _KV_PYTHON
    b = c.p[0]
    c.p += 1
    is_map[0] = b < 0x90 or b >= 0xde
    if b < 0xa0:
        length[0] = b & 0x0f
        return CK_OK
    p = ck_take(c, 2 if b == 0xdc or b == 0xde else 4)
    if p == NULL:
        return _KV_PYTHON
    length[0] = ck_load_be16(p) if b == 0xdc or b == 0xde else ck_load_be32(p)
    return CK_OK


cdef inline int _kv_valid_str(ck_cursor* c, const uint8_t** s, size_t* n) noexcept nogil:
    """Past a valid str, read (_KV_PYTHON: not one); or past any other valid object,
    with *s NULL."""
    cdef ck_cursor at = c[0]
    s[0] = NULL
    if _kv_valid(c, 0) != CK_OK:
        return _KV_PYTHON
    if _kv_str(&at, s, n) != CK_OK:
        s[0] = NULL
    return CK_OK


cdef int _kv_event(ck_cursor* c, const _kv_filter* f, _kv_out* out) noexcept nogil:
    """One event into ``out``, the cursor past it (every byte of it checked: _kv_valid)."""
    cdef const uint8_t* fields[_F_COUNT]
    cdef const uint8_t* kind = NULL
    cdef const uint8_t* s
    cdef size_t kind_size = 0, n
    cdef uint32_t length = 0, i, _pair
    cdef int field
    cdef bint is_map, stored, removed
    cdef ck_cursor at
    memset(fields, 0, sizeof(fields))
    if _kv_head(c, &length, &is_map) != CK_OK:
        return _KV_PYTHON
    if not is_map:
        if length == 0 or _kv_valid_str(c, &kind, &kind_size) != CK_OK or kind == NULL:
            return _KV_PYTHON
        stored = _kv_is(kind, kind_size, b"BlockStored")
        removed = _kv_is(kind, kind_size, b"BlockRemoved")
        for i in range(1, length):
            field = -1
            if stored and i <= _F_GROUP + 1:
                field = i - 1
            elif removed and i <= 3:
                field = _REMOVED_ORDER[i - 1]
            if field >= 0:
                fields[field] = c.p
            if _kv_valid(c, 1) != CK_OK:
                return _KV_PYTHON
    else:
        for _pair in range(length):
            if ck_left(c) == 0 or _kv_is_container(c.p[0]):
                return _KV_PYTHON  # a key msgpack cannot hash
            if _kv_valid_str(c, &s, &n) != CK_OK:
                return _KV_PYTHON
            if s != NULL:
                for field in range(_F_COUNT):
                    if _kv_is(s, n, _FIELD_NAMES[field]):
                        fields[field] = c.p  # a key twice: the last, as a dict keeps it
            if _kv_valid(c, 1) != CK_OK:
                return _KV_PYTHON
        if not _kv_at(fields[_F_TYPE], c.end, &at) or _kv_str(&at, &kind, &kind_size) != CK_OK:
            return _KV_PYTHON
    if _kv_is(kind, kind_size, b"BlockStored"):
        return _kv_stored(fields, c.end, f, out)
    if _kv_is(kind, kind_size, b"BlockRemoved"):
        return _kv_removed(fields, c.end, f, out)
    if _kv_is(kind, kind_size, b"AllBlocksCleared"):
        return CK_OK if _kv_record(out, _CLEAR_SIZE, _OP_CLEAR, f) != NULL else _KV_NO_MEMORY
    return CK_OK  # another type: a later release's, not about the blocks held


cdef int _kv_events(ck_cursor* c, const _kv_filter* f, _kv_out* out) noexcept nogil:
    """A batch's events (an array, or _KV_PYTHON) into ``out``, the cursor past them."""
    cdef uint32_t length, _event
    cdef bint is_map
    cdef int status
    if _kv_head(c, &length, &is_map) != CK_OK or is_map:
        return _KV_PYTHON
    for _event in range(length):
        status = _kv_event(c, f, out)
        if status != CK_OK:
            return status
    return CK_OK


cdef int _kv_batch(const uint8_t* buf, size_t size, const _kv_filter* f,
                   _kv_out* out) noexcept nogil:
    """A batch's records into ``out``: CK_OK, _KV_PYTHON or _KV_NO_MEMORY. Every byte
    is checked as it is read (_kv_valid), each byte once but the events of a batch
    sent as a map, checked then read."""
    cdef ck_cursor c
    cdef const uint8_t* events = NULL
    cdef const uint8_t* s
    cdef size_t n
    cdef uint32_t length, _rest, _pair
    cdef bint is_map
    cdef int status
    c.p = buf
    c.end = buf + size
    if _kv_head(&c, &length, &is_map) != CK_OK:
        return _KV_PYTHON
    if not is_map:  # [ts, events, rank, ...]
        if length < 2 or _kv_valid(&c, 1) != CK_OK:
            return _KV_PYTHON
        status = _kv_events(&c, f, out)
        if status != CK_OK:
            return status
        for _rest in range(2, length):
            if _kv_valid(&c, 1) != CK_OK:
                return _KV_PYTHON
        return CK_OK if c.p == c.end else _KV_PYTHON
    for _pair in range(length):
        if ck_left(&c) == 0 or _kv_is_container(c.p[0]):
            return _KV_PYTHON
        if _kv_valid_str(&c, &s, &n) != CK_OK:
            return _KV_PYTHON
        if s != NULL and _kv_is(s, n, b"events"):
            events = c.p  # a key twice: the last, as a dict keeps it
        if _kv_valid(&c, 1) != CK_OK:
            return _KV_PYTHON
    if c.p != c.end or events == NULL:
        return _KV_PYTHON
    c.p = events
    return _kv_events(&c, f, out)


def decode_kv_batch(payload, int rank, keep) -> tuple[list[bytes], int]:
    """A batch's payload as records for ``rank``, and its events that were malformed
    (coordkit._kvevents.decode_batch, which reads the batches this does not)."""
    cdef _kv_filter f
    cdef _kv_out out
    cdef Py_buffer view
    cdef int status, k
    cdef size_t i, start = 0
    cdef list media, records
    if (
        type(keep) is not _Filter
        or not 0 <= rank
        or len(keep.media) > _KV_MAX_MEDIA
        or len(keep.groups) > _KV_MAX_MEDIA
        or not all(type(g) is int and -(1 << 63) <= g < (1 << 63) for g in keep.groups)
        or not all(type(m) is str for m in keep.media)
    ):
        return _decode_batch_py(payload, rank, keep)
    media = [m.encode() for m in keep.media]
    f.block_size = keep.block_size
    f.rank = rank
    f.n_media = len(media)
    for k in range(f.n_media):
        f.media[k] = <const uint8_t*>PyBytes_AS_STRING(media[k])
        f.media_size[k] = PyBytes_GET_SIZE(media[k])
    f.n_groups = len(keep.groups)
    for k in range(f.n_groups):
        f.groups[k] = keep.groups[k]
    memset(&out, 0, sizeof(out))
    _acquire(payload, &view)
    try:
        with nogil:
            status = _kv_batch(<const uint8_t*>view.buf, <size_t>view.len, &f, &out)
        if status == _KV_NO_MEMORY:
            raise MemoryError()
        if status != CK_OK:
            return _decode_batch_py(payload, rank, keep)
        records = []
        for i in range(out.n):
            records.append(PyBytes_FromStringAndSize(<char*>out.data + start, out.ends[i] - start))
            start = out.ends[i]
        return records, 0
    finally:
        free(out.data)
        free(out.ends)
        PyBuffer_Release(&view)
