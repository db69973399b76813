"""Test plumbing, written once for tests/ and bench/.

- ``fixtures``: the pytest plugin (``impl``, ``c_impl``, ``py_impl``, clusters,
  coordinators, ``zmqutil``), registered by the root conftest.py;
- ``implementations``: loading an implementation, skipping or failing without one;
- ``peers``: raw protocol peers (multipart, and Megatron-Core 0.19's single
  frames) and the wire's header values, nothing of coordkit;
- ``cluster``: a coordinator with raw peers around it, and the addresses to bind;
- ``scripted``: a bare ROUTER on the test's event loop playing the coordinator to a Client;
- ``processes``: child Pythons that import this coordkit, fake engine processes;
- ``extension``: the session's build of the ``_zmqutil_c`` binding helper.
"""
