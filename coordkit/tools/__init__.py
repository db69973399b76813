"""The tools built on coordkit: the ``coordkit`` command and its benchmark harness.

The product (protocol, coordinators, client, engine endpoint) never imports them.
"""
