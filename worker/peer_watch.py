"""A ring of TCP connections between the nodes of a job, so that a survivor tells the
control plane at once when a node's workers vanish.

The control plane treats a dropped agent connection as a lost node only once a survivor
confirms it with a broken-peer report (service/presence.py; alone, a drop waits out the
blip bound, 5 s). With gloo a survivor's collective fails within a second and the worker
reports as it dies (worker/runtime.py's excepthook). With NCCL it does not: a survivor
whose peer's GPU process is gone waits inside the collective (on one host, over P2P or
shared memory, there is no socket to break), so the report never came and a lost GPU node
cost the whole bound (measured on two H100s: the node lost 5.0 s after an agent SIGKILL,
training again at 8.5-8.8 s).

Each node's first worker listens on a TCP port and connects to the next node's listener
(ranks of the node leaders, in a ring), so it holds a connection to each of its two
neighbours. A connection that ends without the peer's goodbye (`close`, which
`Runtime.finish` calls) means the peer process is gone: the watch reports a broken peer
once, from its own thread, whatever the training thread is stuck in. Two connections per
node, whatever the job's size; the addresses travel with the gather that `restore` does
anyway. Threads are daemons; nothing here ever blocks the training thread.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable

log = logging.getLogger("ftrain.peer_watch")

BYE = b"bye\n"


def local_address(toward: str | None) -> str:
    """The address of this host that routes toward `toward` (MASTER_ADDR: reachable by the
    other nodes), without sending anything; loopback when it cannot be told."""
    if toward:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((socket.gethostbyname(toward), 9))
                return s.getsockname()[0]
        except OSError:
            pass
    return "127.0.0.1"


class PeerWatch:
    """One node's part of the ring: `listen`, then `join` with the ring's addresses."""

    def __init__(self, report: Callable[[str], None], host: str | None = None):
        self._report = report
        self._host = host or local_address(os.environ.get("MASTER_ADDR"))
        self._server: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closing = False
        self._reported = False
        self.address: str | None = None

    def listen(self) -> str:
        """Start listening; the "host:port" the previous node in the ring connects to."""
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((self._host, 0))
        server.listen(4)
        self._server = server
        self.address = f"{self._host}:{server.getsockname()[1]}"
        threading.Thread(target=self._accept, name="ftrain-peer-accept", daemon=True).start()
        return self.address

    def join(self, ring: list[str | None], me: int) -> None:
        """Connect to the next listener after ring[me] (None entries are not node leaders)."""
        leaders = [i for i, a in enumerate(ring) if a]
        if len(leaders) < 2 or me not in leaders:
            return
        nxt = ring[leaders[(leaders.index(me) + 1) % len(leaders)]]
        if len(leaders) == 2 and leaders.index(me) == 1:
            return  # two nodes: one connection between them is the whole ring
        assert nxt is not None
        # On a thread: a peer behind a firewall that drops the connection must not hold up
        # the start (the connection is there in a millisecond otherwise).
        threading.Thread(target=self._connect, args=(nxt,), name="ftrain-peer-connect", daemon=True).start()

    def _connect(self, nxt: str) -> None:
        host, _, port = nxt.rpartition(":")
        try:
            conn = socket.create_connection((host, int(port)), timeout=5.0)
        except OSError as exc:
            log.info("peer watch: cannot reach the next node at %s (%s); a lost node is found by "
                     "its lease", nxt, exc)
            return
        conn.settimeout(None)
        self._watch(conn, nxt)

    def _accept(self) -> None:
        assert self._server is not None
        while not self._closing:
            try:
                conn, peer = self._server.accept()
            except OSError:
                return
            self._watch(conn, f"{peer[0]}:{peer[1]}")

    def _watch(self, conn: socket.socket, peer: str) -> None:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        with self._lock:
            if self._closing:
                conn.close()
                return
            self._conns.append(conn)
        threading.Thread(target=self._read, args=(conn, peer), name="ftrain-peer-watch", daemon=True).start()

    def _read(self, conn: socket.socket, peer: str) -> None:
        got = b""
        try:
            while True:
                data = conn.recv(64)
                if not data:
                    break
                got += data
        except OSError:
            pass
        if self._closing or got.endswith(BYE):
            return
        with self._lock:
            if self._reported:
                return
            self._reported = True
        log.info("peer watch: the connection from %s ended without a goodbye; reporting a broken peer", peer)
        try:
            self._report(f"peer watch: the node worker at {peer} is gone (its connection closed)")
        except Exception as exc:  # noqa: BLE001 - the lease still finds the node
            log.info("peer watch: could not report the broken peer: %s", exc)

    def close(self) -> None:
        """Say goodbye on every connection and stop (a clean end is no broken peer)."""
        with self._lock:
            self._closing = True
            conns, self._conns = self._conns, []
        for conn in conns:
            try:
                conn.sendall(BYE)
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()
        if self._server is not None:
            self._server.close()
