# cython: language_level=3
"""Declarations of slots.h: slotted objects made and filled without their __init__."""


cdef extern from "includes/slots.h":
    object ck_alloc(object cls)
    int ck_set_slot(object descr, object obj, object value) except -1
