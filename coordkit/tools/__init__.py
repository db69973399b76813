"""The tools built on coordkit: the ``coordkit`` command, its demo, a fake engine and the bench.

The product (protocol, coordinators, client, engine endpoint) never imports
them. Every import here is relative: a vendored copy's tools run that copy.
"""
