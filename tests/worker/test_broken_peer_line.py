"""A plain script's worker that dies of a lost peer prints the error, then spends seconds in
the interpreter's teardown: the agent reads the error line from the worker's file and
reports the broken peer at once (worker/following.py `_report_broken_peer`, through
worker/links.py `report_broken_peer`, the runtime's one way too), as the runtime's
workers do themselves, so a member whose agent's connection dropped is lost at once
(service/presence.py)."""

from __future__ import annotations

import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.helpers.processes import wait_for
from tests.worker.group_output import Exited, follow, write_worker
from worker.links import ServiceLink
from worker.protocol import says_peer_gone
from worker.torchrun import WorkerGroup

GLOO = ("RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
        "[10.0.0.2]:3541")


@pytest.mark.parametrize(("line", "gone"), [
    (GLOO, True),
    (f"[rank0]: {GLOO}", True),  # torch's own prefix of a worker's uncaught error
    ("RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for recv "
     "operation to complete; Connection reset by peer", True),
    ("torch.distributed.DistNetworkError: failed to recv, got 0 bytes", True),
    ("torch.distributed.DistBackendError: NCCL communicator was aborted on rank 0.", True),
    ("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB", False),
    ("the loader hit a broken pipe, retrying", False),  # what a script prints is no error line
    ("ValueError: bad value", False),
])
def test_which_worker_lines_say_a_peer_is_gone(line, gone):
    assert says_peer_gone(line) is gone


class Recorder(BaseHTTPRequestHandler):
    got: list = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Recorder.got.append((self.path, self.headers.get("Authorization"), body))
        answer = json.dumps({"nodes": ["n2"]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


@pytest.fixture
def control_plane():
    Recorder.got = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _follow(url: str, tmp_path, workers: list[tuple[int, int, int, list[str]]],
            stopping: bool = False) -> None:
    """The agent reads the stderr of `workers`, each (restart, rank, round, lines), then forgets them."""
    for restart, rank, round_, lines in workers:
        write_worker(tmp_path / "logs", restart, rank, lines, rank=rank, round_=round_, stream="stderr")
    g = WorkerGroup("j", 2, Exited(), job_token="job-token", stop_requested=stopping)
    follow(tmp_path, g, server=url)
    shutil.rmtree(tmp_path / "logs")


def test_a_workers_broken_peer_error_is_reported_once_a_round_with_the_job_token(control_plane, tmp_path,
                                                                                   monkeypatch):
    closed: list[ServiceLink] = []  # the agent's link for a report is closed after it (no leak)
    close = ServiceLink.close
    monkeypatch.setattr(ServiceLink, "close", lambda link: (closed.append(link), close(link)))
    _follow(control_plane, tmp_path, [(0, 0, 0, ["Traceback (most recent call last):", GLOO]),
                                      (0, 1, 0, [GLOO])])
    wait_for(lambda: Recorder.got, 10, "the report")
    path, auth, body = Recorder.got[0]
    assert path == "/v1/jobs/j/broken" and auth == "Bearer job-token"
    assert body["attempt"] == 2 and body["node"] == "n1" and "Connection closed by peer" in body["detail"]
    assert len(Recorder.got) == 1  # once for the round
    wait_for(lambda: len(closed) == 1, 10, "the report's link closed")

    # torchrun re-formed the group (a worker failed), and the new round's group broke too.
    Recorder.got = []
    _follow(control_plane, tmp_path, [(0, 0, 0, [GLOO]), (1, 0, 1, [GLOO, GLOO])])
    wait_for(lambda: len(Recorder.got) == 2, 10, "a report for each round")


def test_no_report_from_a_group_being_stopped_or_of_other_errors(control_plane, tmp_path):
    _follow(control_plane, tmp_path, [(0, 0, 0, [GLOO])], stopping=True)
    _follow(control_plane, tmp_path, [(0, 0, 0, ["ValueError: bad value", "broken pipe"])])
    _follow(control_plane, tmp_path, [(0, 0, 0, ["epoch 1"])])
    # Then one that is reported: by the time it is in, any of the above would be too.
    _follow(control_plane, tmp_path, [(0, 0, 0, ["RuntimeError: Connection reset by peer (the last)"])])
    wait_for(lambda: Recorder.got, 10, "the last group's report")
    assert [b["detail"] for _, _, b in Recorder.got] == [
        "worker output: RuntimeError: Connection reset by peer (the last)"]
