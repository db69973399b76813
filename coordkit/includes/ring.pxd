# cython: language_level=3
"""Declarations of ring.h: the cursors of a ring one thread fills and another empties."""

from libc.stdint cimport uint64_t


cdef extern from "includes/ring.h" nogil:
    ctypedef struct ck_ring:
        uint64_t head  # the producer's: entries below it are written
        uint64_t tail  # the consumer's: entries below it are read

    bint ck_ring_room(ck_ring* r, uint64_t size)  # the producer: room at the head
    void ck_ring_push(ck_ring* r)  # the producer: the entry at the head is written
    void ck_ring_drop(ck_ring* r)  # the producer: one it could not put in
    uint64_t ck_ring_filled(ck_ring* r)  # the consumer: the head (entries below it written)
    void ck_ring_taken(ck_ring* r, uint64_t tail)  # the consumer: those below tail read
    uint64_t ck_ring_dropped(ck_ring* r)  # how many were dropped
