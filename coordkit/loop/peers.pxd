# The peers' life: engines and clients joining, living and leaving (its methods: peers.pyx).
# Included by _loop_c.pxd.

cdef class Peers:
    cdef Loop loop  # whose tables it works on

    cdef register(self, int32_t engine)
    cdef engine_hello(self, int32_t engine)
    cdef count_formats(self)
    cdef PD pd_room(self)
    cdef register_role(self, int32_t engine)
    cdef restarted(self, int32_t engine, int fd)
    cdef watch(self, int rank, int fd)
    cdef int32_t new_engine(self, int32_t engine, int fd) except -2
    cdef connect(self, int32_t client)
    cdef int32_t tenant(self, str name)
    cdef int32_t vacant_client(self) except -2
    cdef remove_client(self, int32_t client)
    cdef connection_events(self)
    cdef end(self, bytes identity, int fd)
    cdef drop_ended(self)
    cdef goodbye(self, int32_t client)
    cdef heartbeat(self, int32_t engine)
    cdef disconnect(self, int32_t engine)
    cdef client_gone(self, int32_t client, bint unreachable=*, bint closed=*)
    cdef drop_client(self, int32_t client)
    cdef bytes identity(self, int32_t client)
    cdef bytes engine_identity(self, int rank)
