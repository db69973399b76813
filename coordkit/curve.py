"""CURVE authentication and encryption (CurveZMQ), through pyzmq's ``zmq.auth``.

A coordinator given a secret key and a directory of authorized public keys
(``coordkit serve --curve-secret-key FILE --curve-authorized-keys DIR``) makes
its ROUTER a CURVE server, and a ZAP handler on its context admits only those
keys: a peer without a key, or with another key, is refused during the
handshake, before any of its messages reaches the loop (which counts it from
its ROUTER's socket monitor).
``coordkit keygen DIR NAME`` writes a key pair (``NAME.key`` is the public
half to hand out, ``NAME.key_secret`` the pair to keep).

Clients and engines connect with ``curve_server_key`` (the coordinator's
public key: its ``.key`` file or its z85 text) and ``curve_keys`` (their own
``.key_secret`` file, or a ``(public, secret)`` pair).
"""

from __future__ import annotations

import os
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

__all__ = ["KeySource", "ServerKey", "keygen", "secure_client", "CurveServer"]

#: A key pair: a ``.key_secret`` file (both halves), or (public, secret) in z85.
KeySource = str | os.PathLike[str] | tuple[bytes, bytes]
#: The coordinator's public key: its ``.key`` file, or the z85 text.
ServerKey = str | os.PathLike[str] | bytes


def keygen(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` (public) and ``NAME.key_secret`` (the pair) into ``directory``."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(directory, name)
    return Path(public), Path(secret)


def _pair(keys: KeySource) -> tuple[bytes, bytes]:
    if isinstance(keys, tuple):
        return keys
    public, secret = zmq.auth.load_certificate(keys)
    if secret is None:
        raise ValueError(f"coordkit: {os.fspath(keys)} holds no secret key (a .key_secret file)")
    return public, secret


def _public(key: ServerKey) -> bytes:
    if isinstance(key, bytes):
        return key
    return zmq.auth.load_certificate(key)[0]


def secure_client(socket: zmq.Socket, server_key: ServerKey, keys: KeySource) -> None:
    """Make ``socket`` (not yet connected) a CURVE client of the server with ``server_key``."""
    public, secret = _pair(keys)
    socket.curve_serverkey = _public(server_key)
    socket.curve_publickey = public
    socket.curve_secretkey = secret


class CurveServer:
    """A ROUTER made a CURVE server admitting the keys found in ``authorized``.

    Call :meth:`secure` before the socket binds, :meth:`close` before it closes.
    """

    def __init__(
        self,
        context: zmq.Context,
        secret_key: str | os.PathLike[str],
        authorized: str | os.PathLike[str],
    ):
        self._keys = _pair(secret_key)
        if not Path(authorized).is_dir():
            raise ValueError(f"coordkit: {os.fspath(authorized)} is not a directory of keys")
        self._authenticator = ThreadAuthenticator(context)
        self._authenticator.start()
        self._authenticator.configure_curve(domain="*", location=os.fspath(authorized))

    def secure(self, router: zmq.Socket) -> None:
        router.curve_server = True
        router.curve_publickey, router.curve_secretkey = self._keys

    def close(self) -> None:
        """Stop the ZAP handler."""
        self._authenticator.stop()
