"""What a client may make the control plane hold before a request reaches the app
(`service.http_limits`), with raw sockets against a real uvicorn: a head over its size or
line limit is a 431, a request not sent whole in time is ended, and past the connection
limit a new connection is refused while those open are served."""

from __future__ import annotations

import select
import socket

import pytest

from tests.helpers.processes import ControlPlane

pytestmark = pytest.mark.shared_control_plane  # (those given more environment start their own)

SHORT = {"FTRAIN_REQUEST_TIMEOUT_S": "2"}
ANSWER_WAIT_S = 30.0  # generous: the server's deadline is 2 s, the machine may be loaded


def connect(cp: ControlPlane) -> socket.socket:
    sock = socket.create_connection((cp.host, cp.port), timeout=ANSWER_WAIT_S)
    return sock


def answer(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (or the wait ends)."""
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    return got


def send_until_answered(sock: socket.socket, data: bytes, piece: int = 16 * 1024) -> None:
    """Send `data` in pieces until the server answers or closes."""
    sent = 0
    while sent < len(data):
        if select.select([sock], [], [], 0)[0]:
            break  # an answer (or the close) came: stop before the server's reset
        try:
            sent += sock.send(data[sent:sent + piece])
        except (BrokenPipeError, ConnectionResetError):
            break


def status(raw: bytes) -> int:
    assert raw.startswith(b"HTTP/1.1 "), raw[:200]
    return int(raw.split(b" ", 2)[1])


def peak_rss_bytes(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/<pid>/status")


def test_a_head_over_the_size_limit_is_a_431_and_not_held(control_plane):
    """A 32 MiB header: refused at the limit; the server's peak memory does not grow with it."""
    before = peak_rss_bytes(control_plane.proc.pid)
    big = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (32 * 1024 * 1024) + b"\r\n\r\n"
    with connect(control_plane) as sock:
        send_until_answered(sock, big)
        raw = answer(sock)
    assert status(raw) == 431 and b"request head larger than" in raw
    assert peak_rss_bytes(control_plane.proc.pid) - before < 8 * 1024 * 1024


def test_a_head_with_too_many_lines_is_a_431(control_plane):
    head = b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(500))
    with connect(control_plane) as sock:
        send_until_answered(sock, head + b"\r\n")
        raw = answer(sock)
    assert status(raw) == 431 and b"header lines" in raw


def test_a_head_within_the_limits_is_served(control_plane):
    head = b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: %s\r\n" % (i, b"v" * 100)
                                                                for i in range(50))
    with connect(control_plane) as sock:
        sock.sendall(head + b"Connection: close\r\n\r\n")
        assert status(answer(sock)) == 200


@pytest.mark.parametrize("control_plane", [SHORT], indirect=True)
def test_a_request_whose_head_does_not_come_whole_is_ended_with_a_408(control_plane):
    """Five connections each: silent, half a request line, a head without its blank line."""
    partial = [b"", b"GET /heal", b"GET /healthz HTTP/1.1\r\nHost: x\r\n"]
    socks = [connect(control_plane) for _ in range(5 * len(partial))]
    try:
        for i, sock in enumerate(socks):
            sock.sendall(partial[i % len(partial)])
        for sock in socks:  # each one ended by the server, none left open
            raw = answer(sock)
            assert status(raw) == 408 and b"not received whole" in raw
    finally:
        for sock in socks:
            sock.close()


@pytest.mark.parametrize("control_plane", [SHORT], indirect=True)
def test_a_request_whose_body_does_not_come_whole_is_ended(control_plane):
    with connect(control_plane) as sock:
        sock.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + control_plane.user_token.encode() +
                     b"\r\nContent-Length: 100\r\n\r\n{\"name\"")
        assert answer(sock) == b""  # closed (the app heard a disconnect), not kept open


@pytest.mark.parametrize("control_plane", [{"FTRAIN_MAX_CONNECTIONS": "16"}], indirect=True)
def test_past_the_connection_limit_a_new_connection_is_refused_and_open_ones_are_served(control_plane):
    held = [connect(control_plane) for _ in range(16)]
    try:
        with connect(control_plane) as extra:
            raw = answer(extra)
        assert status(raw) == 503 and b"FTRAIN_MAX_CONNECTIONS" in raw
        held[0].sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert status(answer(held[0])) == 200
    finally:
        for sock in held:
            sock.close()
