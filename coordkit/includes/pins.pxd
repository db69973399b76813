# cython: language_level=3
"""Declarations of pins.h: frames from Python buffers, copied when small, pinned when large."""

from .libzmq cimport zmq_msg_t


cdef extern from "includes/pins.h":
    # Release the buffers libzmq is done with (the GIL held): every send and receive does.
    void ck_pins_sweep()
    # `msg` initialised with the bytes of `obj`, copied below `copy_below`, else pinned.
    int ck_msg_from_object(zmq_msg_t* msg, object obj, size_t copy_below) except -1
