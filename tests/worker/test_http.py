"""The retry policy of worker/http.py and its callers, against a real HTTP server on a free
port (a thread of this process) that answers from a script."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

import service.client as client_module
import worker.http as http_module
import worker.rendezvous as ftrain_rdzv
import worker.rendezvous.transport as transport_module
from service.client import FtrainClient, TooManyRequests
from tests.helpers.processes import free_port
from worker.http import ApiError, ControlPlaneClient, HttpError, Unreachable, server_urls
from worker.rendezvous import FtrainRendezvousBackend, RendezvousGoneError, Transport
from worker.runtime import Fenced, LinkError, ServiceLink


@dataclass
class Script:
    """What the server answers: (status, JSON body or None) per request, the last one for ever."""

    answers: list[tuple[int, object]] = field(default_factory=lambda: [(200, {})])
    headers: dict[str, str] = field(default_factory=dict)  # sent with every answer
    delay_s: float = 0.0
    seen: list[tuple[str, str, object, dict]] = field(default_factory=list)

    def next(self) -> tuple[int, object]:
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


@pytest.fixture
def server() -> Iterator[tuple[str, Script]]:
    yield from _scripted()


@pytest.fixture
def server2() -> Iterator[tuple[str, Script]]:
    """A second one: another control-plane replica."""
    yield from _scripted()


def _scripted() -> Iterator[tuple[str, Script]]:
    script = Script()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            script.seen.append((self.command, self.path, json.loads(raw) if raw else None,
                                dict(self.headers)))
            if script.delay_s:
                time.sleep(script.delay_s)
            status, body = script.next()
            data = b"" if body is None else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in script.headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_DELETE = _answer

        def log_message(self, *args) -> None:
            pass

    class Server(ThreadingHTTPServer):
        def handle_error(self, request, client_address) -> None:
            pass  # a client that timed out and left: expected here

    httpd = Server(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", script
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def client(server) -> Iterator[ControlPlaneClient]:
    c = ControlPlaneClient(server[0], "tok", timeout=2)
    yield c
    c.close()


# ------------------------------------------------------------------ the policy

def test_503_twice_then_200_is_retried_until_it_answers(server, client):
    url, script = server
    script.answers = [(503, {"detail": "etcd away"}), (503, {"detail": "etcd away"}), (200, {"ok": 1})]
    assert client.call("POST", "/x", {"a": 1}, retry_s=5) == {"ok": 1}
    assert [(m, p, b) for m, p, b, _ in script.seen] == [("POST", "/x", {"a": 1})] * 3
    assert script.seen[0][3]["Authorization"] == "Bearer tok"


@pytest.mark.parametrize("status", [502, 503, 504])
def test_a_retryable_status_without_budget_is_one_try_and_unreachable(server, client, status):
    url, script = server
    script.answers = [(status, {"detail": "away"})]
    with pytest.raises(Unreachable) as caught:
        client.call("GET", "/x")
    assert (caught.value.status, caught.value.attempts, len(script.seen)) == (status, 1, 1)
    assert "away" in caught.value.problem


def test_retries_stop_at_the_deadline_with_growing_pauses(server, client):
    url, script = server
    script.answers = [(503, {"detail": "away"})]
    start = time.monotonic()
    with pytest.raises(Unreachable) as caught:
        client.call("GET", "/x", retry_s=1.0)
    took = time.monotonic() - start
    assert 1.0 <= took < 2.0
    # backoff 0.1 doubling, jittered by 0.5-1: between 4 (0.1+0.2+0.4+0.8) and 7 (halved) tries
    assert 4 <= caught.value.attempts == len(script.seen) <= 7


@pytest.mark.parametrize("status", [400, 401, 404, 409, 410, 422, 500])
def test_other_errors_are_answers_raised_at_once(server, client, status):
    url, script = server
    script.answers = [(status, {"detail": f"said {status}"})]
    with pytest.raises(ApiError) as caught:
        client.call("POST", "/x", retry_s=5)
    assert (caught.value.status, caught.value.detail, len(script.seen)) == (status, f"said {status}", 1)


def _recorded_sleeps(monkeypatch, module) -> list[float]:
    slept: list[float] = []
    real = time.sleep
    monkeypatch.setattr(module.time, "sleep", lambda s: (slept.append(s), real(min(s, 0.01))))
    return slept


def test_a_429_is_retried_after_the_wait_its_retry_after_asks_for(server, client, monkeypatch):
    url, script = server
    script.answers = [(429, {"detail": "busy"}), (200, {"ok": 1})]
    script.headers = {"Retry-After": "0.7"}
    slept = _recorded_sleeps(monkeypatch, http_module)
    assert client.call("POST", "/x", {"a": 1}, retry_s=5) == {"ok": 1}
    assert len(script.seen) == 2 and len(slept) == 1 and slept[0] >= 0.7


def test_a_429_asking_for_more_than_the_budget_left_is_unreachable_at_once(server, client, monkeypatch):
    url, script = server
    script.answers = [(429, {"detail": "busy"})]
    script.headers = {"Retry-After": "30"}
    slept = _recorded_sleeps(monkeypatch, http_module)
    with pytest.raises(Unreachable) as caught:
        client.call("GET", "/x", retry_s=5)
    assert (caught.value.status, len(script.seen), slept) == (429, 1, [])


def test_ftrain_client_retries_a_429_after_its_retry_after_even_for_a_cancel(server, monkeypatch):
    """A 429 was refused before anything was done: any request may be sent again."""
    url, script = server
    script.answers = [(429, {"detail": "busy"}), (429, {"detail": "busy"}), (202, {"id": "j"})]
    script.headers = {"Retry-After": "2"}
    slept = _recorded_sleeps(monkeypatch, client_module)
    with FtrainClient(url, "tok") as c:
        assert c.cancel_job("j") == {"id": "j"}
    assert len(script.seen) == 3 and len(slept) == 2 and all(s >= 2 for s in slept)


def test_ftrain_client_follows_logs_again_after_a_429s_retry_after(server, monkeypatch):
    url, script = server
    script.answers = [(429, {"detail": "busy"}), (200, {"seq": 0, "line": "a"}),
                      (200, {"state": "SUCCEEDED"}), (200, {"seq": 1, "line": "b"})]
    script.headers = {"Retry-After": "3"}
    slept = _recorded_sleeps(monkeypatch, client_module)
    with FtrainClient(url, "tok") as c:
        assert [item["line"] for item in c.follow_logs("j")] == ["a", "b"]
    assert len(slept) == 1 and slept[0] >= 3


def test_ftrain_client_gives_up_on_429s_after_its_busy_budget(server, monkeypatch):
    url, script = server
    script.answers = [(429, {"detail": "busy"})]
    script.headers = {"Retry-After": "7"}
    slept = _recorded_sleeps(monkeypatch, client_module)
    with FtrainClient(url, "tok") as c, pytest.raises(TooManyRequests) as caught:
        c.get_job("j")
    assert sum(slept) <= client_module.BUSY_WAIT_S and len(slept) >= 3
    assert len(script.seen) == len(slept) + 1
    assert "too busy" in str(caught.value) and "Try again later" in str(caught.value)


def test_a_refused_connection_is_retried_until_the_deadline():
    c = ControlPlaneClient(f"http://127.0.0.1:{free_port()}", timeout=1)
    start = time.monotonic()
    with pytest.raises(Unreachable) as caught:
        c.call("GET", "/x", retry_s=0.5)
    assert 0.5 <= time.monotonic() - start < 2
    assert caught.value.status is None and caught.value.attempts > 1
    assert "ConnectError" in caught.value.problem
    c.close()


def test_a_read_timeout_is_no_answer(server):
    url, script = server
    script.delay_s = 0.5
    c = ControlPlaneClient(url, timeout=0.1)
    with pytest.raises(Unreachable) as caught:
        c.call("GET", "/x")
    assert caught.value.status is None and "Timeout" in caught.value.problem
    c.close()


def test_an_empty_answer_is_none_and_models_are_sent_as_json(server, client):
    from worker.protocol import CorruptReport

    url, script = server
    script.answers = [(204, None)]
    assert client.call("POST", "/x", CorruptReport(reason="bad")) is None
    assert script.seen[0][2] == {"reason": "bad"}


def test_environment_proxies_are_ignored(server, client, monkeypatch):
    url, script = server
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("ALL_PROXY", "http://127.0.0.1:9")
    c = ControlPlaneClient(url)
    assert c.call("GET", "/x") == {}
    c.close()


# ------------------------------------------------------------------ several control planes

def test_server_lists_are_comma_separated():
    assert server_urls(" http://a:8000/, http://b:8000 ,") == ["http://a:8000", "http://b:8000"]
    assert server_urls(["http://a:8000,http://b:8000", "http://c:8000"]) == [
        "http://a:8000", "http://b:8000", "http://c:8000"]
    with pytest.raises(ValueError, match="no control plane URL"):
        server_urls(" , ")


def test_a_dead_replica_is_passed_over_at_once_and_the_next_one_kept(server):
    url, script = server
    dead = f"http://127.0.0.1:{free_port()}"
    c = ControlPlaneClient(f"{dead},{url}", suffix="/v1/jobs/j")
    start = time.monotonic()
    assert c.call("GET", "/x") == {}  # a budget of 0: one try at each replica
    assert c.call("GET", "/y") == {}
    assert time.monotonic() - start < 1  # no backoff sleep between replicas
    assert c.base_url == f"{url}/v1/jobs/j"
    assert [p for _, p, _, _ in script.seen] == ["/v1/jobs/j/x", "/v1/jobs/j/y"]
    c.close()


def test_a_503_sends_the_request_to_the_other_replica_which_is_kept(server, server2):
    (url1, script1), (url2, script2) = server, server2
    script1.answers = [(503, {"detail": "etcd away"})]
    c = ControlPlaneClient([url1, url2])
    assert c.call("POST", "/x", {"a": 1}) == {} and c.call("POST", "/x", {"a": 2}) == {}
    assert len(script1.seen) == 1 and [b for _, _, b, _ in script2.seen] == [{"a": 1}, {"a": 2}]
    script2.answers = [(503, {"detail": "etcd away"})]
    with pytest.raises(Unreachable) as caught:  # all replicas fail: no answer, as with one
        c.call("POST", "/x", retry_s=0.3)
    assert caught.value.status == 503 and len(script1.seen) >= 2
    c.close()


def test_ftrain_client_fails_over_on_a_refused_connection_and_sticks(server):
    url, script = server
    script.answers = [(200, {"id": "j1"})]
    dead = f"http://127.0.0.1:{free_port()}"
    with FtrainClient(f"{dead},{url}", "tok") as c:
        assert c.submit({"name": "x"}) == {"id": "j1"}  # never sent to the dead one: safe
        assert c.server == url
        assert c.get_job("j1") == {"id": "j1"}
    assert len(script.seen) == 2
    with FtrainClient(f"{dead},{dead}", "tok") as c, pytest.raises(Exception, match=dead):
        c.get_job("j1")


def test_every_error_is_an_http_error():
    assert issubclass(ApiError, HttpError) and issubclass(Unreachable, HttpError)


# ------------------------------------------------------------------ the rendezvous transport

def test_rendezvous_410_is_gone_at_once(server):
    url, script = server
    script.answers = [(410, {"detail": "attempt 0 is over"})]
    transport = Transport(url, "job-abcdef-a0", "t", retry_timeout_s=5)
    with pytest.raises(RendezvousGoneError, match="attempt 0 is over"):
        FtrainRendezvousBackend(transport).get_state()
    assert len(script.seen) == 1 and script.seen[0][1] == "/v1/rdzv/job-abcdef-a0/state"
    transport.close()


def test_rendezvous_and_service_link_take_a_list_of_control_planes(server):
    url, script = server
    script.answers = [(200, {"state": None})]
    dead = f"127.0.0.1:{free_port()}"  # no scheme: the endpoint's form, for each of the list
    transport = Transport(f"{dead},{url}", "job-abcdef-a0", "t", retry_timeout_s=5)
    FtrainRendezvousBackend(transport).get_state()
    assert transport.base_url == url and script.seen[-1][1] == "/v1/rdzv/job-abcdef-a0/state"
    transport.close()
    script.answers = [(200, {"items": []})]
    link = ServiceLink(f"http://{dead},{url}", "j1", "t", attempt=1)
    link._call("GET", "/snapshots")
    assert script.seen[-1][1] == "/v1/jobs/j1/snapshots"


def test_rendezvous_503_until_retry_timeout_is_a_connection_error(server):
    url, script = server
    script.answers = [(503, {"detail": "etcd away"})]
    transport = Transport(url, "job-abcdef-a0", "t", retry_timeout_s=1)
    start = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match=r"did not answer .* tries \(HTTP 503: etcd away\)"):
        FtrainRendezvousBackend(transport).get_state()
    assert 1 <= time.monotonic() - start < 2 and len(script.seen) > 1
    transport.close()


def test_rendezvous_read_timeout_is_the_wait_plus_the_margin(server, monkeypatch):
    url, script = server
    monkeypatch.setattr(transport_module, "READ_MARGIN_S", 0.2)
    script.delay_s = 0.5
    script.answers = [(200, {"state": None, "token": None, "changed": False})]
    transport = Transport(url, "job-abcdef-a0", "t", retry_timeout_s=1)
    # 0.4 s of wait + 0.2 s of margin > the server's 0.5 s: answered
    assert transport.call("GET", "/state", wait_s=0.4) == {"state": None, "token": None, "changed": False}
    with pytest.raises(ftrain_rdzv.ControlPlaneUnreachable, match="ReadTimeout"):
        transport.call("GET", "/state", wait_s=0.0, deadline=time.monotonic())  # 0.2 s < 0.5 s
    transport.close()


def test_endpoint_url_keeps_an_explicit_default_port():
    assert ftrain_rdzv.endpoint_url("http://cp:80") == "http://cp:80"
    assert ftrain_rdzv.endpoint_url("https://cp") == "https://cp"


# ------------------------------------------------------------------ the runtime's link

def test_service_link_retries_a_listing_and_reads_it_into_snapshots(server):
    url, script = server
    record = {"step": 5, "path": "/s/5.pt", "size": 3, "checksum": "abc", "bad": False}
    script.answers = [(503, {"detail": "away"}), (200, {"items": [record], "latest": 5})]
    link = ServiceLink(url, "job-x", "tok", attempt=2)
    items, latest = link.snapshots()
    assert latest == 5 and [(i.step, i.path, i.bad) for i in items] == [(5, "/s/5.pt", False)]
    assert [p for _, p, _, _ in script.seen] == ["/v1/jobs/job-x/snapshots"] * 2


def test_service_link_polls_control_once_and_says_what_failed(server):
    url, script = server
    script.answers = [(503, {"detail": "away"})]
    link = ServiceLink(url, "job-x", "tok", attempt=0)
    with pytest.raises(LinkError) as caught:
        link.control()
    assert caught.value.status == 503 and len(script.seen) == 1
    script.answers = [(200, {"id": 3, "action": "checkpoint_stop", "reason": "cancel"})]
    ctl = link.control()
    assert (ctl.id, ctl.action, ctl.reason) == (3, "checkpoint_stop", "cancel")


def test_service_link_commit_refused_with_409_is_fenced(server):
    from worker.snapshot import WrittenSnapshot

    url, script = server
    script.answers = [(409, {"detail": "attempt 1 is not the job's attempt 2"})]
    link = ServiceLink(url, "job-x", "tok", attempt=1)
    written = WrittenSnapshot(step=4, path="/s/4.pt", size=1, checksum="c", write_s=0.5)
    with pytest.raises(Fenced, match="not the job's attempt"):
        link.commit(written, stall_s=0.01, control_id=None)
    assert len(script.seen) == 1
    assert script.seen[0][2] == {"step": 4, "path": "/s/4.pt", "size": 1, "checksum": "c", "attempt": 1,
                                 "control_id": None, "stall_s": 0.01, "write_s": 0.5, "shards": None}


def test_service_link_commit_without_an_answer_is_worth_retrying_and_a_4xx_is_not(server, monkeypatch):
    from worker.links import CommitUnreachable
    from worker.snapshot import CommitUnavailable, WrittenSnapshot

    monkeypatch.setattr(ServiceLink, "RETRY_S", 0.3)
    url, script = server
    link = ServiceLink(url, "job-x", "tok", attempt=1)
    written = WrittenSnapshot(step=4, path="/s/4.pt", size=1, checksum="c", write_s=0.5)
    for status in (503, 500):
        script.answers = [(status, {"detail": "etcd away"})]
        with pytest.raises(CommitUnavailable, match="step 4"):
            link.commit(written, stall_s=0.01, control_id=None)
    script.answers = [(422, {"detail": "bad"})]
    with pytest.raises(LinkError) as caught:
        link.commit(written, stall_s=0.01, control_id=None)
    assert not isinstance(caught.value, CommitUnreachable) and caught.value.status == 422
    dead = ServiceLink(f"http://127.0.0.1:{free_port()}", "job-x", "tok", attempt=1)
    with pytest.raises(CommitUnreachable, match="unreachable"):
        dead.commit(written, stall_s=0.01, control_id=None)
