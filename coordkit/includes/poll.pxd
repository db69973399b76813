# cython: language_level=3
"""Declarations of <poll.h>: the loop sleeps in poll(2) on its sockets' ZMQ_FDs."""


cdef extern from "<poll.h>" nogil:
    ctypedef unsigned long nfds_t

    struct pollfd:
        int fd
        short events
        short revents

    enum:
        POLLIN

    int poll(pollfd* fds, nfds_t nfds, int timeout)
