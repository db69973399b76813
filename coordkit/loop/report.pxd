# What the loop reports: stats() and metrics() (its methods: report.pyx).
# Included by _loop_c.pxd.

cdef class Report:
    cdef Loop loop  # whose tables it works on
