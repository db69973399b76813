# cython: language_level=3
"""Declarations of framepool.h: a pool of large outgoing frames, reused once libzmq is done."""

from .libzmq cimport zmq_msg_t


cdef extern from "includes/framepool.h" nogil:
    ctypedef struct ck_buffer_pool:
        pass

    ck_buffer_pool* ck_buffer_pool_new()
    void ck_buffer_pool_close(ck_buffer_pool* pool)
    int ck_buffer_msg(ck_buffer_pool* pool, zmq_msg_t* msg, size_t size)
