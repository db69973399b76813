"""A TCP proxy whose connections can be cut: a network blip between two peers.

``Proxy(upstream)`` listens on a free loopback port (``address``) and joins each
connection made to it to a new one to ``upstream`` (``tcp://HOST:PORT``), copying
bytes both ways on a thread of its own. ``cut()`` closes every connection it
carries, both sides (each peer sees its connection end, as in a proxy's restart);
new connections are joined again as before. ``refuse()`` also stops accepting:
a peer that reconnects finds nobody. ``outage()`` cuts and holds the connections
made meanwhile unjoined (their handshakes wait) until ``restore()``: a network
that is down for a while and comes back.
"""

from __future__ import annotations

import selectors
import socket
import threading

from .processes import free_tcp_address

CHUNK = 1 << 16


class Proxy:
    def __init__(self, upstream: str):
        self.upstream = upstream
        host, port = upstream.removeprefix("tcp://").rsplit(":", 1)
        self._upstream = (host, int(port))
        self.address = free_tcp_address()
        host, port = self.address.removeprefix("tcp://").rsplit(":", 1)
        self._listener = socket.create_server((host, int(port)))
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._peers: dict[socket.socket, socket.socket] = {}  # each side -> the other
        self._lock = threading.Lock()
        self._cut = self._refuse = self._closed = self._held = False
        self._holding = False  # the listener is out of the selector: connections wait
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def cut(self) -> None:
        """Close every connection carried now (the next ones are carried again)."""
        with self._lock:
            self._cut = True

    def outage(self) -> None:
        """Close every connection carried now, and join no new one until restore()."""
        with self._lock:
            self._cut = self._held = True

    def restore(self) -> None:
        """After an outage(): join the connections that waited, and the next ones."""
        with self._lock:
            self._held = False

    def refuse(self) -> None:
        """Close every connection carried now and accept no new one."""
        with self._lock:
            self._cut = self._refuse = True

    def close(self) -> None:
        with self._lock:
            self._cut = self._refuse = self._closed = True
        self._thread.join(5)

    def _run(self) -> None:
        while True:
            with self._lock:
                cut, refuse, closed, held = self._cut, self._refuse, self._closed, self._held
                self._cut = False
            if cut:
                for side in list(self._peers):
                    self._drop(side)
            if held != self._holding and not refuse:
                if held:
                    self._selector.unregister(self._listener)
                else:
                    self._selector.register(self._listener, selectors.EVENT_READ)
                self._holding = held
            if refuse and self._listener.fileno() >= 0:
                if not self._holding:
                    self._selector.unregister(self._listener)
                self._listener.close()
            if closed:
                self._selector.close()
                return
            for key, _ in self._selector.select(0.02):
                side = key.fileobj
                assert isinstance(side, socket.socket)
                if side is self._listener:
                    self._accept()
                elif side in self._peers:
                    self._copy(side)

    def _accept(self) -> None:
        downstream, _ = self._listener.accept()
        upstream = socket.create_connection(self._upstream)
        for side, other in ((downstream, upstream), (upstream, downstream)):
            side.setblocking(True)  # small writes on loopback: a blocking send is brief
            self._peers[side] = other
            self._selector.register(side, selectors.EVENT_READ)

    def _copy(self, side: socket.socket) -> None:
        try:
            data = side.recv(CHUNK)
            if data:
                self._peers[side].sendall(data)
                return
        except OSError:
            pass
        self._drop(side)

    def _drop(self, side: socket.socket) -> None:
        """Close a connection carried: both its sides (once)."""
        if side not in self._peers:
            return
        for s in (side, self._peers.pop(side)):
            self._peers.pop(s, None)
            self._selector.unregister(s)
            s.close()
