"""Test plumbing, written once for tests/ and bench/.

- ``fixtures``: the pytest plugin (``impl``, ``c_impl``, ``py_impl``, clusters),
  registered by the root conftest.py;
- ``implementations``: loading an implementation, skipping or failing without one;
- ``peers``: raw protocol peers that know the wire format and nothing of coordkit;
- ``cluster``: a coordinator with raw peers around it.
"""
