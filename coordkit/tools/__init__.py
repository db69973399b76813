"""The tools built on coordkit: the ``coordkit`` command, its demo, a fake engine and the bench.

The product (protocol, coordinators, client, engine endpoint) never imports
them; ``coordkit.FakeEngine`` is a lazy alias of :mod:`coordkit.tools.fake_engine`'s.
"""
