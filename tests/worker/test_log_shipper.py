"""LogShipper against a real local HTTP server that stands in for the control plane's log
endpoint: it enforces a body limit (413), can be "away" (503) and forgets jobs (404).

The shipper runs without its background thread (`start=False`) and the test calls `flush`,
so each step is deterministic.
"""

from __future__ import annotations

import http.server
import json
import logging
import threading
import time

import pytest

from worker import log_shipper
from worker.http import ControlPlaneClient
from worker.log_shipper import LogShipper
from worker.protocol import MAX_LINE_CHARS, MAX_SHIPMENT_BYTES, LogLineIn, cut_line


class FakeLogEndpoint(http.server.ThreadingHTTPServer):
    """POST /v1/jobs/<id>/logs: 204 and the lines kept, or 413 / 503 / 404 as told."""

    daemon_threads = True

    def __init__(self, max_body_bytes: int = 64 * 1024):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.max_body_bytes = max_body_bytes
        self.away = False
        self.forgotten = False
        self.gone: set[str] = set()
        self.lines: dict[str, list[dict]] = {}
        self.bodies: list[int] = []  # sizes of the bodies it took
        self.refused_413 = 0
        self.thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def texts(self, job: str) -> list[str]:
        return [x["line"] for x in self.lines.get(job, [])]


class _Handler(http.server.BaseHTTPRequestHandler):
    server: FakeLogEndpoint

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        length = int(self.headers["Content-Length"])
        body = self.rfile.read(length)
        job = self.path.split("/")[3]
        if self.server.away:
            return self._answer(503, "etcd away")
        if length > self.server.max_body_bytes:
            self.server.refused_413 += 1
            return self._answer(413, f"request body larger than {self.server.max_body_bytes} bytes")
        if self.server.forgotten:  # the node's lease lapsed (e.g. in an outage of the control plane)
            return self._answer(404, "no node named 'node-a' is registered (its lease may have lapsed)")
        if job in self.server.gone:
            return self._answer(404, f"no job with id {job!r}")
        self.server.bodies.append(length)
        self.server.lines.setdefault(job, []).extend(json.loads(body)["lines"])
        self._answer(204, "")

    def _answer(self, status: int, detail: str) -> None:
        body = json.dumps({"detail": detail}).encode() if detail else b""
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def endpoint():
    server = FakeLogEndpoint()
    yield server
    server.shutdown()
    server.server_close()


def shipper_for(endpoint: FakeLogEndpoint) -> tuple[LogShipper, ControlPlaneClient]:
    client = ControlPlaneClient(endpoint.url, "t", timeout=5)
    return LogShipper(client, "node-a", start=False), client


def line(text: str, rank: int | None = 0) -> LogLineIn:
    return LogLineIn(rank=rank, line=text, time=time.time())


def test_a_burst_is_split_into_shipments_under_the_body_limit_and_all_arrive(endpoint):
    shipper, client = shipper_for(endpoint)
    sent = [f"{i:04d} " + "x" * 3000 for i in range(3000)]  # ~9 MB at once
    for text in sent:
        shipper.add("j", 1, line(text))
    shipper.flush()
    assert endpoint.texts("j") == sent
    assert endpoint.refused_413 == 0 and max(endpoint.bodies) <= MAX_SHIPMENT_BYTES
    assert shipper.pending() == 0
    client.close()


def test_a_413_halves_the_shipments_and_nothing_is_lost(endpoint):
    endpoint.max_body_bytes = 5_000  # a control plane with a smaller limit than the agent expects
    shipper, client = shipper_for(endpoint)
    sent = [f"{i:04d} " + "ü" * 500 for i in range(200)]
    for text in sent:
        shipper.add("j", 1, line(text))
    shipper.flush()
    assert endpoint.texts("j") == sent
    assert endpoint.refused_413 > 0 and shipper.max_shipment_bytes <= 5_000
    client.close()


def test_lines_wait_while_the_control_plane_is_away_then_arrive_in_order(endpoint):
    shipper, client = shipper_for(endpoint)
    endpoint.away = True
    for i in range(50):
        shipper.add("j", 1, line(f"early {i}"))
    shipper.flush()
    for i in range(50):
        shipper.add("j", 1, line(f"late {i}"))
    shipper.flush()
    assert endpoint.texts("j") == [] and shipper.pending() == 100
    endpoint.away = False
    shipper.flush()
    assert endpoint.texts("j") == [f"early {i}" for i in range(50)] + [f"late {i}" for i in range(50)]
    client.close()


def test_a_full_buffer_drops_the_oldest_and_a_marker_says_how_many(endpoint, monkeypatch):
    monkeypatch.setattr(log_shipper, "MAX_PENDING_LINES", 100)
    shipper, client = shipper_for(endpoint)
    shipper.add("j", 1, line("shipped before"))
    shipper.flush()
    endpoint.away = True
    for i in range(250):
        shipper.add("j", 1, line(f"during {i}"))
        if i % 50 == 0:
            shipper.flush()  # the control plane does not answer
    endpoint.away = False
    shipper.flush()
    got = endpoint.lines["j"]
    texts = [x["line"] for x in got]
    assert texts[0] == "shipped before"
    assert texts[1] == "ftrain: 150 lines dropped on node node-a while the control plane was away"
    assert got[1]["rank"] is None and got[1]["stream"] == "stderr"
    assert texts[2:] == [f"during {i}" for i in range(150, 250)]  # the newest 100, in order
    client.close()


def test_a_job_the_control_plane_no_longer_knows_is_dropped_with_a_log_line(endpoint, caplog):
    shipper, client = shipper_for(endpoint)
    endpoint.gone.add("old")
    for i in range(5):
        shipper.add("old", 1, line(f"o{i}"))
        shipper.add("new", 1, line(f"n{i}"))
    with caplog.at_level(logging.WARNING, logger="ftrain.agent"):
        shipper.flush()
    assert endpoint.texts("new") == [f"n{i}" for i in range(5)]
    assert shipper.pending() == 0
    assert any("dropped 5 log lines of job old" in r.getMessage() and "404" in r.getMessage()
               for r in caplog.records)
    client.close()


def test_the_background_thread_ships_without_being_asked(endpoint):
    client = ControlPlaneClient(endpoint.url, "t", timeout=5)
    shipper = LogShipper(client, "node-a")
    try:
        shipper.add("j", 1, line("hello"))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and endpoint.texts("j") != ["hello"]:
            time.sleep(0.05)
        assert endpoint.texts("j") == ["hello"]
    finally:
        shipper.close()
        client.close()


def test_an_over_long_line_is_cut_with_a_visible_mark():
    text = "a" * 10_000
    cut = cut_line(text)
    assert len(cut) == MAX_LINE_CHARS and cut.startswith("a" * 3000)
    assert cut.endswith("[ftrain: line cut, 10000 characters in all]")
    assert cut_line("short") == "short"
    LogLineIn(rank=0, line=cut, time=0.0)  # what the control plane accepts


def test_a_flood_faster_than_shipping_waits_for_room_and_loses_nothing(endpoint, monkeypatch):
    """A reader of torchrun's output (`wait_for_room`) waits while the queue is full and the
    control plane answers: 20 times the queue's bound arrive, in order, with no marker."""
    monkeypatch.setattr(log_shipper, "MAX_PENDING_LINES", 100)
    client = ControlPlaneClient(endpoint.url, "t", timeout=5)
    shipper = LogShipper(client, "node-a")  # its background thread ships every SHIP_EVERY_S
    sent = [f"flood {i}" for i in range(2000)]
    for text in sent:
        shipper.add("j", 1, line(text), wait_for_room=True)
    deadline = time.monotonic() + 30
    while len(endpoint.texts("j")) < len(sent) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert endpoint.texts("j") == sent
    shipper.close()
    client.close()


def test_a_reader_waiting_for_room_drops_the_oldest_once_the_control_plane_is_away(endpoint, monkeypatch):
    monkeypatch.setattr(log_shipper, "MAX_PENDING_LINES", 100)
    shipper, client = shipper_for(endpoint)
    endpoint.away = True
    shipper.add("j", 1, line("first"))
    shipper.flush()  # no answer: the readers stop waiting (the queue is bounded meanwhile)
    done = threading.Event()

    def reader():
        for i in range(250):
            shipper.add("j", 1, line(f"during {i}"), wait_for_room=True)
        done.set()

    threading.Thread(target=reader, daemon=True).start()
    assert done.wait(10), "the reader waited for room although no control plane answered"
    endpoint.away = False
    shipper.flush()
    texts = endpoint.texts("j")
    assert texts[0] == "ftrain: 151 lines dropped on node node-a while the control plane was away"
    assert texts[1:] == [f"during {i}" for i in range(150, 250)]
    client.close()


def test_lines_wait_while_the_control_plane_does_not_know_the_node_then_arrive(endpoint):
    """A 404 about the node (its lease lapsed in an outage; it registers again) is no answer
    about the lines: they wait (before, it was taken for the job's 404 and dropped them all)."""
    shipper, client = shipper_for(endpoint)
    endpoint.forgotten = True
    for i in range(30):
        shipper.add("j", 1, line(f"queued {i}"))
    shipper.flush()
    assert endpoint.texts("j") == [] and shipper.pending() == 30
    endpoint.forgotten = False
    shipper.flush()
    assert endpoint.texts("j") == [f"queued {i}" for i in range(30)]
    client.close()
