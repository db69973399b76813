# cython: language_level=3
"""The C-level header codec, for the Cython modules to cimport (and a host's own, through
``__init__.pxd``).

Every function reads a msgpack metadata frame from ``buf[0:n]`` (or writes one
into ``out``), holds no Python object and needs no GIL. Reads return a
``ck_status``: ``CK_OK`` (0) or a negative error; ``ck_strstatus`` names it.
"""

from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t

from .includes.cursor cimport ck_cursor, ck_write_int, ck_write_uint


ctypedef struct ck_submit:
    int64_t header
    uint32_t length     # elements in the metadata array
    int64_t rid
    size_t offset       # start of the verbatim remainder; 0 until the rid was read

# A SUBMIT's QoS fields, from a client granted them (ck_read_qos).
ctypedef struct ck_qos:
    int64_t priority    # in [PRIORITY_MIN, PRIORITY_MAX]
    int64_t deadline_ms  # >= 0: how long it may wait at the coordinator (0: no deadline)

ctypedef struct ck_entry:
    int64_t rid
    bint needs_detokenize
    bint valid  # a well-formed entry; the others were skipped, the batch read on

# Megatron-Core's single-frame SUBMIT: `[header, rid, prompt, sampling_params]` (0.19's),
# `[20, rid, prompt, sampling_params, multi_modal_data]` (main's) or
# `[24, rid, prompt, sampling_params, kv_meta, src_block_ids]` (main's KV submission).
ctypedef struct ck_single_submit:
    int64_t header
    int64_t rid
    uint32_t length     # its fields: 4, 5 or 6
    size_t prompt       # offset of the prompt; 0 until the rid was read
    size_t params       # offset of the sampling params (the prompt ends here); 0 until read whole
    # offset of its last field after the params (multi_modal_data, src_block_ids), n when
    # it has 4: the params (and kv_meta) end here
    size_t extra

# One entry of a single-frame ENGINE_REPLY `[21, [map, ...]]` (or ENGINE_REPLY_PARTIAL).
ctypedef struct ck_single_entry:
    size_t offset       # the entry's bytes are buf[offset : offset + size]
    size_t size
    int64_t rid         # its "request_id", valid when status == CK_OK
    int status          # CK_OK, CK_NOT_MAP, CK_NO_REQUEST_ID or CK_BAD_REQUEST_ID

ctypedef struct ck_batch_entry:  # one entry of a SUBMIT_BATCH or a REPLY_BATCH
    int64_t rid
    size_t params_offset    # SUBMIT_BATCH: the entry's sampling params are
    size_t params_size      # buf[params_offset : params_offset + params_size], verbatim
    bint flag               # a client's SUBMIT_BATCH: hashed; REPLY_BATCH: final
    ck_qos qos              # read with CK_QOS_WIDTH: its QoS fields (0, 0 when it has none)

cdef enum ck_status:
    CK_OK = 0
    CK_TRUNCATED = -1        # an object runs past the end of the frame
    CK_BAD_TYPE = -2         # not the type this position needs
    CK_TRAILING = -3         # bytes after the last object
    CK_RANGE = -4            # an int (the header) that does not fit int64
    CK_TOO_MANY = -5         # more entries (or hashes) than `capacity`
    CK_RID_RANGE = -6        # a request id that does not fit int64
    CK_BAD_LENGTH = -7       # an array with the wrong number of elements
    CK_BAD_HEADER = -8       # a reply header: not ENGINE_REPLY or ENGINE_REPLY_PARTIAL
    CK_RESERVED = -9         # the reserved byte 0xc1
    CK_TOO_DEEP = -10        # containers nested deeper than msgpack unpacks
    CK_NOT_MAP = -11         # ck_read_single_reply, per entry: the entry is not a map
    CK_NO_REQUEST_ID = -12   # ck_read_single_reply, per entry: no "request_id" key
    CK_BAD_REQUEST_ID = -13  # ck_read_single_reply, per entry: "request_id" not an int64
    CK_PROMPT_STR = -14      # ck_prompt_hashes: a str prompt, which has no token ids
    CK_BAD_TOKEN = -15       # ck_prompt_hashes: an element not an int in [0, 2**32)
    CK_QOS_RANGE = -16       # a priority out of its range, or a negative deadline

cdef enum:
    CK_HEADER_MAX = 10          # bytes ck_write_header may write: [h]
    CK_HEADER_INT_MAX = 19      # bytes ck_write_header_int may write: [h, v]
    CK_SUBMIT_PREFIX_MAX = 23   # array32 header + two int64: the prefix of ck_write_submit
    CK_SINGLE_PREFIX_MAX = 19   # fixarray + two int64: the prefix of ck_write_single_submit
    CK_INT_MAX = 9              # room ck_write_int and ck_write_uint need
    CK_ARRAY_MAX = 5            # bytes ck_write_array may write
    CK_BATCH_HEAD_MAX = 15      # bytes ck_write_batch_head may write: [h, [ of n
    # The width of ck_read_submit_batch that reads a client granted QoS: entries of 3
    # fields, or of 5 with the QoS after the rid, [rid, priority, deadline_ms, params, hashed].
    CK_QOS_WIDTH = 5

cdef const char* ck_strstatus(int status) noexcept nogil

# `[header, ...]` with at least one element; *end is the offset just after the
# header int. Nothing after it is read.
cdef int ck_read_header(const uint8_t* buf, size_t n, int64_t* header, uint32_t* length,
                        size_t* end) noexcept nogil

# `[header, rid, *rest]`: validates the whole frame, the rest only for
# structure (any msgpack types, ending exactly at n). On an error after the rid
# was read, out.offset > 0 and out.rid holds it; before, out.offset == 0.
cdef int ck_read_submit(const uint8_t* buf, size_t n, ck_submit* out) noexcept nogil

# The QoS fields of a SUBMIT that ck_read_submit read whole, from a client granted them
# (its array two longer than its header's layout): `priority, deadline_ms` at
# submit.offset, two ints (CK_BAD_TYPE otherwise) in range (CK_QOS_RANGE: a priority
# outside [PRIORITY_MIN, PRIORITY_MAX], a negative deadline); then submit.offset is
# moved past them, where its params start. So the metadata written for an engine from
# that offset on (ck_write_submit) carries no QoS: engines never see them.
cdef int ck_read_qos(const uint8_t* buf, size_t n, ck_submit* submit,
                     ck_qos* out) noexcept nogil

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

# `[header, [` of a batch of `count` entries (the entries follow) into
# CK_BATCH_HEAD_MAX bytes; returns the bytes written.
cdef size_t ck_write_batch_head(uint8_t* out, int64_t header, uint32_t count) noexcept nogil

# `[21, [[rid, needs_detokenize], ...]]` or `[22, [rid, ...]]`. The batch must
# be readable whole (an error status otherwise); an entry of the wrong shape,
# or whose rid does not fit int64, is skipped and marked valid = 0 (salvage:
# the good entries of a batch are still delivered). The first `capacity`
# entries go to `entries` (PARTIAL entries get needs_detokenize = 0).
# CK_TOO_MANY comes only for an otherwise valid frame; with it and with CK_OK,
# *count is the number of entries, so the caller can grow `entries` and read again.
cdef int ck_read_reply(const uint8_t* buf, size_t n, int64_t* header, ck_entry* entries,
                       uint32_t capacity, uint32_t* count) noexcept nogil


# `[header, value]`, two int64s, validated whole (the client's replies `[21, rid]`,
# an engine's ABORT `[23, rid]`).
cdef int ck_read_header_int(const uint8_t* buf, size_t n, int64_t* header,
                            int64_t* value) noexcept nogil

# `[header, rid, ...]`: an int64 header and at least one int64 rid, validated whole
# (RELEASE_KV to a coordkit prefill, KV_READ_DONE from a coordkit decode); *count rids,
# the first at buf[*first] (read them with ck_read_int).
cdef int ck_read_rids(const uint8_t* buf, size_t n, int64_t* header, uint32_t* count,
                      size_t* first) noexcept nogil

# SUBMIT_BATCH `[95, [entry, ...]]`, validated whole: each entry `[rid, params, hashed]`
# (width 3, from a client) or `[rid, params]` (width 2, to an engine), the params any
# msgpack object, skipped structurally; with CK_QOS_WIDTH, a client granted QoS: each
# entry `[rid, params, hashed]` or `[rid, priority, deadline_ms, params, hashed]`, its
# QoS checked as ck_read_qos checks them (its params span starts after them).
# Capacity and CK_TOO_MANY as for ck_read_reply; on any other error *count is the
# number of entries read as far as their rid, the last one perhaps no further (the rids
# of those within capacity are in `entries`), so that their requests can be named.
cdef int ck_read_submit_batch(const uint8_t* buf, size_t n, uint32_t width,
                              ck_batch_entry* entries, uint32_t capacity,
                              uint32_t* count) noexcept nogil

# HANDOFF `[104, [[rid, kv_meta], ...]]` (a coordkit prefill's), validated whole; as
# ck_read_submit_batch of width 2, each kv_meta's span in params_offset/params_size.
cdef int ck_read_handoff(const uint8_t* buf, size_t n, ck_batch_entry* entries,
                         uint32_t capacity, uint32_t* count) noexcept nogil

# REPLY_BATCH `[96, [[rid, final], ...]]`, validated whole; as ck_read_submit_batch.
cdef int ck_read_reply_batch(const uint8_t* buf, size_t n, ck_batch_entry* entries,
                             uint32_t capacity, uint32_t* count) noexcept nogil

# Any of the above (`header` HEADER_SUBMIT_BATCH, HEADER_HANDOFF or HEADER_REPLY_BATCH) into
# *entries, a malloc'd array of *capacity that is grown (reserve) to hold every entry
# read, whether the batch reads whole or not. CK_TOO_MANY when memory ran out; *count
# is then at most *capacity, the entries that could be held.
cdef int ck_read_batch_into(const uint8_t* buf, size_t n, int64_t header, uint32_t width,
                            ck_batch_entry** entries, uint32_t* capacity,
                            uint32_t* count) noexcept nogil

# The writers of the forms above, for the endpoints that build whole frames: an array
# head; an int64 or a uint64 in its smallest form (as msgpack.packb) is ck_write_int's or
# ck_write_uint's (includes/cursor.h, inline), which need CK_INT_MAX bytes of room.
cdef size_t ck_write_array(uint8_t* out, uint32_t length) noexcept nogil

# The reads the others are made of, at a cursor over a frame: an array head (its
# length), an int (any msgpack int; a uint64 beyond int64 is CK_RANGE, its bits in
# *value). The cursor moves past what was read.
cdef int ck_read_array(ck_cursor* c, uint32_t* length) noexcept nogil
cdef int ck_read_int(ck_cursor* c, int64_t* value) noexcept nogil

# -- Megatron-Core's single-frame dialect -------------------------------------
#
# Nothing below decodes a prompt or a reply map: they are skipped structurally
# (any msgpack, as deep as msgpack unpacks, str contents not checked as UTF-8)
# and handed back as byte spans of `buf`.

# `[header, rid, ...]`, an array of 4, 5 or 6 (out.length) with int64 header and
# rid, read as far as the rid: O(1) whatever the prompt. out.prompt is where the
# fields after the rid start (they run to n), out.params 0: nothing after the rid
# is read, so nothing there is checked either (Megatron's engine decodes the whole
# frame, and fails on one that does not decode). Which header takes which length
# is the caller's to check.
cdef int ck_read_single_head(const uint8_t* buf, size_t n,
                             ck_single_submit* out) noexcept nogil

# `[header, rid, prompt, sampling_params, ...]`: ck_read_single_head, then the
# prompt (a str or an array) and the params (a map) skipped (a walk of the
# prompt's elements, one table lookup per token id), then the fields after them
# (any msgpack: multi_modal_data, or kv_meta and src_block_ids), ending exactly
# at n. On an error after the rid was read, out.prompt > 0 and out.rid holds it;
# before, out.prompt == 0. The header is not checked.
cdef int ck_read_single_submit(const uint8_t* buf, size_t n,
                               ck_single_submit* out) noexcept nogil

# `[21, [entry, ...]]` (finished requests) or `[22, [entry, ...]]` (Megatron
# main's partial replies), *header which, each entry a map whose top-level
# "request_id" (a str key, compared by bytes; the last one wins, as in a
# decoded map) is its server id. The frame must be valid whole (an array of 2,
# header 21 or 22, an array of entries each skippable, nothing trailing) or
# the status says why;
# then each of the first `capacity` entries gets its span, and a status of
# its own: CK_OK with its rid, CK_NOT_MAP, CK_NO_REQUEST_ID or
# CK_BAD_REQUEST_ID (not an int, or a uint64 beyond int64). CK_TOO_MANY comes
# only for an otherwise valid frame; with it and with CK_OK, *count is the
# number of entries, so the caller can grow `entries` to *count and read again.
cdef int ck_read_single_reply(const uint8_t* buf, size_t n, int64_t* header,
                              ck_single_entry* entries, uint32_t capacity,
                              uint32_t* count) noexcept nogil

# buf[0:n] is exactly one msgpack str or array (a prompt): CK_OK, or why not.
cdef int ck_check_prompt(const uint8_t* buf, size_t n) noexcept nogil

# buf[0:n] is exactly one msgpack map (sampling params, a reply body): CK_OK, or why not.
cdef int ck_check_map(const uint8_t* buf, size_t n) noexcept nogil

# What ck_streamed_tokens found in a reply body.
cdef enum:
    CK_NO_TOKENS = 0    # neither "new_tokens" nor "generated_tokens"
    CK_NEW_TOKENS = 1   # "new_tokens": those since the last partial
    CK_ALL_TOKENS = 2   # "generated_tokens": all so far

# The tokens a reply body carries (exactly one msgpack map, its structure checked
# whole): its top-level "new_tokens" (*kind CK_NEW_TOKENS), else its "generated_tokens"
# (CK_ALL_TOKENS), the last of each name winning, into out, *count of them; each an int
# in [0, 2**32) (CK_BAD_TOKEN otherwise). *kind CK_NO_TOKENS, *count 0 with neither.
# More than `capacity`: CK_TOO_MANY with *count the number, before any is read.
cdef int ck_streamed_tokens(const uint8_t* buf, size_t n, int* kind, uint32_t* out,
                            uint32_t capacity, uint32_t* count) noexcept nogil

# The chained block hashes of a token-id prompt, exactly
# coordkit.protocol.block_hashes(tokens, block_size): one little-endian u64
# per full block into out (8 bytes each), *count of them. buf[0:n] must be
# exactly one msgpack array of ints in [0, 2**32), every one checked, or
# *count is 0 and the status says why: CK_PROMPT_STR for a str (route it by
# load), CK_BAD_TOKEN, CK_BAD_TYPE, CK_TRUNCATED, CK_TRAILING... block_size 0
# is CK_BAD_LENGTH.
# When the array has more full blocks than `capacity`, CK_TOO_MANY with
# *count = the number it has, before the tokens are read: grow and call again.
cdef int ck_prompt_hashes(const uint8_t* buf, size_t n, size_t block_size, uint8_t* out,
                          size_t capacity, size_t* count) noexcept nogil

# Exactly the bytes ck_write_single_submit writes for these arguments.
cdef size_t ck_single_submit_size(int64_t header, int64_t rid, size_t prompt_len,
                                  size_t params_len) noexcept nogil

# `[header, rid, <prompt bytes>, <params bytes>]` (a fixarray of 4, ints in
# their smallest form) into `out`, which holds
# CK_SINGLE_PREFIX_MAX + prompt_len + params_len bytes. The spans are copied
# as they are: check them first (ck_check_prompt, ck_check_map). Returns the
# bytes written.
cdef size_t ck_write_single_submit(uint8_t* out, int64_t header, int64_t rid,
                                   const uint8_t* prompt, size_t prompt_len,
                                   const uint8_t* params, size_t params_len) noexcept nogil

# The size in tokens of a prompt frame, from at most its first 5 bytes: a
# msgpack array's length (token ids), a msgpack str's ceil(bytes / 4), and
# otherwise ceil(n / 4) (coordkit._codec_py.prompt_tokens is the contract).
cdef uint64_t ck_prompt_tokens(const uint8_t* buf, size_t n) noexcept nogil
