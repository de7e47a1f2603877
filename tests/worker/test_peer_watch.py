"""worker/peer_watch.py: a node worker SIGKILLed is reported by its ring neighbours at
once; one that leaves with `close` (a clean finish) is not."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from worker.peer_watch import PeerWatch

pytestmark = pytest.mark.integration  # a child process, SIGKILLed

REPO = Path(__file__).resolve().parents[2]
CHILD = """
import sys, time
import pytest

from worker.peer_watch import PeerWatch

pytestmark = pytest.mark.integration  # a child process, SIGKILLed
w = PeerWatch(lambda detail: None, host="127.0.0.1")
print(w.listen(), flush=True)
ring = sys.stdin.readline().split()
w.join([None if a == "-" else a for a in ring], int(sys.argv[1]))
print("joined", flush=True)
if sys.stdin.readline().strip() == "close":
    w.close()
    print("closed", flush=True)
time.sleep(60)
"""


class Reports:
    def __init__(self) -> None:
        self.got: list[str] = []
        self.event = threading.Event()

    def __call__(self, detail: str) -> None:
        self.got.append(detail)
        self.event.set()


def _ring(child_rank: int, close: bool) -> tuple[list[Reports], float]:
    """Ranks 0, 2 and 4 lead nodes here (1, 3 do not); `child_rank` is a child process, the
    others watches of this process. The child is then closed, or SIGKILLed."""
    reports = [Reports(), Reports()]
    watches = [PeerWatch(r, host="127.0.0.1") for r in reports]
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(child_rank)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd=REPO,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        addresses = {r: w.listen() for r, w in zip([x for x in (0, 2, 4) if x != child_rank], watches)}
        addresses[child_rank] = child.stdout.readline().strip()
        ring = [addresses.get(i) for i in range(5)]
        child.stdin.write(" ".join(a or "-" for a in ring) + "\n")
        child.stdin.flush()
        for rank, w in zip(sorted(set(addresses) - {child_rank}), watches):
            w.join(ring, rank)
        assert child.stdout.readline().strip() == "joined"
        time.sleep(0.2)  # the connections accepted on every side
        start = time.monotonic()
        if close:
            child.stdin.write("close\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "closed"
        else:
            child.send_signal(signal.SIGKILL)
        for r in reports:  # a report comes within milliseconds; none in a second is none
            r.event.wait(1.0 if close else 5.0)
        return reports, time.monotonic() - start
    finally:
        child.kill()
        child.wait()
        for w in watches:
            w.close()


def test_a_node_worker_killed_is_reported_by_both_ring_neighbours_at_once():
    reports, took = _ring(child_rank=2, close=False)
    assert all(len(r.got) == 1 and "is gone" in r.got[0] for r in reports)
    assert took < 2.0


def test_a_node_worker_that_says_goodbye_is_no_broken_peer():
    reports, _ = _ring(child_rank=4, close=True)
    assert all(r.got == [] for r in reports)
