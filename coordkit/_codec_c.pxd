# cython: language_level=3
"""The C-level header codec, for the Cython coordinator to cimport.

Every function reads a msgpack metadata frame from ``buf[0:n]`` (or writes one
into ``out``), holds no Python object and needs no GIL. Reads return a
``ck_status``: ``CK_OK`` (0) or a negative error; ``ck_strstatus`` names it.
"""

from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t


ctypedef struct ck_submit:
    int64_t header
    uint32_t length     # elements in the metadata array
    int64_t rid
    size_t offset       # start of the verbatim remainder; 0 until the rid was read

ctypedef struct ck_entry:
    int64_t rid
    bint needs_detokenize

ctypedef struct ck_batch_entry:  # one entry of a SUBMIT_BATCH or a REPLY_BATCH
    int64_t rid
    size_t params_offset    # SUBMIT_BATCH: the entry's sampling params are
    size_t params_size      # buf[params_offset : params_offset + params_size], verbatim
    bint flag               # a client's SUBMIT_BATCH: hashed; REPLY_BATCH: final

cdef enum ck_status:
    CK_OK = 0
    CK_TRUNCATED = -1       # an object runs past the end of the frame
    CK_BAD_TYPE = -2        # not the type this position needs
    CK_TRAILING = -3        # bytes after the last object
    CK_RANGE = -4           # an int (the header) that does not fit int64
    CK_TOO_MANY = -5        # ck_read_reply: more entries than `capacity`
    CK_RID_RANGE = -6       # a request id that does not fit int64
    CK_BAD_LENGTH = -7      # an array with the wrong number of elements
    CK_BAD_HEADER = -8      # ck_read_reply: neither ENGINE_REPLY nor ENGINE_REPLY_PARTIAL
    CK_RESERVED = -9        # the reserved byte 0xc1
    CK_TOO_DEEP = -10       # containers nested deeper than msgpack unpacks

cdef enum:
    CK_HEADER_MAX = 10          # bytes ck_write_header may write: [h]
    CK_HEADER_INT_MAX = 19      # bytes ck_write_header_int may write: [h, v]
    CK_SUBMIT_PREFIX_MAX = 23   # array32 header + two int64: the prefix of ck_write_submit
    CK_INT_MAX = 9              # bytes ck_write_int or ck_write_uint may write
    CK_ARRAY_MAX = 5            # bytes ck_write_array may write

cdef const char* ck_strstatus(int status) noexcept nogil

# `[header, ...]` with at least one element; *end is the offset just after the
# header int. Nothing after it is read.
cdef int ck_read_header(const uint8_t* buf, size_t n, int64_t* header, uint32_t* length,
                        size_t* end) noexcept nogil

# `[header, rid, *rest]`: validates the whole frame, the rest only for
# structure (any msgpack types, ending exactly at n). On an error after the rid
# was read, out.offset > 0 and out.rid holds it; before, out.offset == 0.
cdef int ck_read_submit(const uint8_t* buf, size_t n, ck_submit* out) noexcept nogil

# Exactly the bytes ck_write_submit writes for these arguments.
cdef size_t ck_submit_size(const ck_submit* prefix, int64_t rid, size_t rest_len) noexcept nogil

# `[prefix.header, rid, *rest]` with prefix.length elements, ints and array
# header in their smallest form; `out` holds rest_len + CK_SUBMIT_PREFIX_MAX
# bytes. Returns the bytes written.
cdef size_t ck_write_submit(uint8_t* out, const ck_submit* prefix, int64_t rid,
                            const uint8_t* rest, size_t rest_len) noexcept nogil

# `[header, value]` into CK_HEADER_INT_MAX bytes; returns the bytes written.
cdef size_t ck_write_header_int(uint8_t* out, int64_t header, int64_t value) noexcept nogil

# `[header]` into CK_HEADER_MAX bytes; returns the bytes written.
cdef size_t ck_write_header(uint8_t* out, int64_t header) noexcept nogil

# `[21, [[rid, needs_detokenize], ...]]` or `[22, [rid, ...]]`, validated whole.
# The first `capacity` entries go to `entries` (PARTIAL entries get
# needs_detokenize = 0). CK_TOO_MANY comes only for an otherwise valid frame;
# with it and with CK_OK, *count is the number of entries, so the caller can
# grow `entries` to *count and read again.
cdef int ck_read_reply(const uint8_t* buf, size_t n, int64_t* header, ck_entry* entries,
                       uint32_t capacity, uint32_t* count) noexcept nogil

# `[header, value]`, two int64s, validated whole (the client's replies `[21, rid]`,
# an engine's ABORT `[23, rid]`).
cdef int ck_read_header_int(const uint8_t* buf, size_t n, int64_t* header,
                            int64_t* value) noexcept nogil

# SUBMIT_BATCH `[95, [entry, ...]]`, validated whole: each entry `[rid, params, hashed]`
# (width 3, from a client) or `[rid, params]` (width 2, to an engine), the params any
# msgpack object, skipped structurally. Capacity and CK_TOO_MANY as for ck_read_reply;
# on any other error *count is the number of entries read whole before the fault
# (those within capacity are in `entries`), so that their requests can be named.
cdef int ck_read_submit_batch(const uint8_t* buf, size_t n, uint32_t width,
                              ck_batch_entry* entries, uint32_t capacity,
                              uint32_t* count) noexcept nogil

# REPLY_BATCH `[96, [[rid, final], ...]]`, validated whole; as ck_read_submit_batch.
cdef int ck_read_reply_batch(const uint8_t* buf, size_t n, ck_batch_entry* entries,
                             uint32_t capacity, uint32_t* count) noexcept nogil

# The writers of the forms above, for the endpoints that build whole frames:
# an int in its smallest form (as msgpack.packb), a uint64 likewise, an array head.
cdef size_t ck_write_int(uint8_t* out, int64_t v) noexcept nogil
cdef size_t ck_write_uint(uint8_t* out, uint64_t v) noexcept nogil
cdef size_t ck_write_array(uint8_t* out, uint32_t length) noexcept nogil
