# Lists through indices (their functions: lists.pyx). Included by _loop_c.pxd.

cdef struct Links:
    # Doubly linked lists through indices (request slots, client indices): each
    # index's neighbours in the one list it is in, UINT32_MAX past its ends.
    uint32_t* older
    uint32_t* newer


cdef struct Ends:  # one list over some Links: its oldest and newest index, UINT32_MAX: empty
    uint32_t oldest
    uint32_t newest
