# The rare paths' frames as Python bytes: read, parsed, sent (its methods: answers.pyx).
# Included by _loop_c.pxd.

cdef class Answers:
    cdef Loop loop  # whose tables it works on

    cdef object parse(self, object spec, int32_t client, int64_t header)
    cdef replace(self, int part, bytes body)
    cdef const uint8_t* held_body(self, bytes body, size_t* size)
    cdef bytes detokenized(self, const uint8_t* body, size_t size)
    cdef list frames(self)
    cdef bytes frame_bytes(self, int part)
    cdef bint send_frames(self, ck_ids* table, int32_t index, list frames)
    cdef reply_to_sender(self, list frames)
    cdef count_frames_out(self, list frames)
