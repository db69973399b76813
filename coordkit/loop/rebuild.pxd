# The rebuild after a coordinator's loss, and a client's blip (its methods:
# rebuild.pyx). Included by _loop_c.pxd.

cdef class Rebuild:
    cdef:
        Loop loop  # whose tables it works on
        # Until the window ends, engines report what they hold and clients what they
        # wait for; meanwhile no HANDLED goes out (a replay may need it all).
        double until
        bint rebuilding
        double window  # its length, from the start (and from a reopen)
        bint cluster  # a cluster's member: reopen() opens it again
        dict awaiting  # REJOIN entries no engine claimed yet: (client, rid) -> partials got
        set aborting  # REJOIN entries aborted before an engine claimed them: (client, rid)
        # What engines' reports adopted in the window, ended or not: a second claim of a
        # server id, or of a client's request id, is refused (nothing is answered twice).
        set claimed_ids
        set claimed_rids
        # Requests of rejoined clients that found no engine yet, by routing id: sent back
        # (RESEND) once one registers, or at the window's end (resend_deferred).
        dict deferred
        Py_ssize_t n_deferred  # len(deferred), read without the GIL
        # Rebuild clients whose connection ended, by routing id: until when their requests
        # wait for their REJOIN (meanwhile their engines get no HANDLED: a replay may
        # need all they kept).
        dict away
        Py_ssize_t n_away  # len(away), read without the GIL
        int n_holding  # engines holding requests of clients away (mark_holding)

    # what the loop calls
    cdef reopen(self)
    cdef held(self, int32_t engine)
    cdef rejoin(self, int32_t client)
    cdef replayed(self, int32_t engine)
    cdef rejoins_nothing(self, int32_t client)
    cdef send_resends(self, dict resend)
    cdef defer(self, int32_t client, int64_t rid)
    cdef resend_deferred(self)
    cdef end_window(self)
    cdef end_holds(self, double now)
    cdef void acknowledge(self) noexcept nogil
    cdef mark_holding(self)
    cdef go_away(self, int32_t client)
    cdef int absent(self)
    cdef returned(self, int32_t client)

    # its own steps
    cdef bint _claimable(self, int64_t server_rid, bytes client_id, int64_t client_rid)
    cdef _refuse_claims(self, int32_t engine, str kind, Py_ssize_t count)
    cdef int32_t _adoptive_client(self, bytes identity, int64_t client_rid) except -2
    cdef _replay(self, uint32_t slot, int64_t start, dict replays)
    cdef _send_replays(self, dict replays)
    cdef _unclaimed(self, int32_t client, int64_t rid, int64_t partials, dict resend)
    cdef _unheld(self, uint32_t slot, dict resend)
    cdef _drop_orphan(self, uint32_t slot)
    cdef _drop_orphans(self, int32_t client)
    cdef void sent_finals(self, int32_t engine, uint32_t count, double now) noexcept nogil
