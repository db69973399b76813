"""Find the libzmq shared object that pyzmq has loaded into this process."""

from __future__ import annotations

import os


def libzmq_candidates() -> list[str]:
    """Paths that may hold pyzmq's libzmq symbols, most likely first.

    A pyzmq wheel bundles ``libzmq-<hash>.so`` and loads it with its backend;
    a pyzmq built against a static libzmq exports the symbols from the backend
    module itself, so that module is the second guess.
    """
    import zmq.backend.cython._zmq as backend  # loads libzmq as a side effect

    candidates: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                name = os.path.basename(path)
                if name.startswith("libzmq") and ".so" in name and path not in candidates:
                    candidates.append(path)
    except OSError:
        pass
    candidates.append(backend.__file__)
    return candidates
