"""Real processes for integration tests: etcd, the control plane (uvicorn), node agents.

Every process is started by PID and stopped by PID; nothing is matched by name.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from service.embedded import EtcdProcess, free_port

REPO = Path(__file__).resolve().parent.parent


def wait_for(predicate: Callable[[], object], timeout_s: float, what: str, interval_s: float = 0.05):
    """Poll `predicate` until it returns something truthy; fail with `what` at the deadline."""
    deadline = time.monotonic() + timeout_s
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except ProcessExited:
            raise
        except Exception as exc:  # noqa: BLE001 - a probe may fail until the thing is up
            last_exc = exc
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}"
                         + (f" (last error: {last_exc!r})" if last_exc else ""))


class ProcessExited(AssertionError):
    """A process a test waits on has died: waiting longer will not help."""


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (from /proc), children first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


class ControlPlane:
    """A real `ftrain serve` (uvicorn) process on a free loopback port."""

    def __init__(self, etcd_endpoint: str, workdir: Path, user_token: str | None = None,
                 node_token: str | None = None, port: int | None = None, env: dict | None = None):
        self.etcd_endpoint = etcd_endpoint
        self.workdir = workdir
        self.user_token = user_token or secrets.token_urlsafe(16)
        self.node_token = node_token or secrets.token_urlsafe(16)
        self.port = port or free_port()
        self.env = env or {}
        self.proc: subprocess.Popen | None = None
        self.snapshot_root = workdir / "snapshots"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> ControlPlane:
        self.workdir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "FTRAIN_USER_TOKEN": self.user_token,
               "FTRAIN_NODE_TOKEN": self.node_token, **self.env}
        log = open(self.workdir / f"control-plane-{self.port}.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "service.cli", "serve", "--etcd", self.etcd_endpoint,
             "--port", str(self.port), "--snapshot-root", str(self.snapshot_root)],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        wait_for(self._healthy, timeout_s, f"control plane on {self.url}")
        return self

    def _healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            log = (self.workdir / f"control-plane-{self.port}.log").read_text()[-3000:]
            raise ProcessExited(f"control plane exited with {self.proc.returncode}:\n{log}")
        return httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def client(self, token: str | None = "user") -> httpx.Client:
        headers = {}
        if token == "user":
            headers["Authorization"] = f"Bearer {self.user_token}"
        elif token == "node":
            headers["Authorization"] = f"Bearer {self.node_token}"
        elif token:
            headers["Authorization"] = f"Bearer {token}"
        return httpx.Client(base_url=self.url, headers=headers, timeout=10)


__all__ = ["ControlPlane", "EtcdProcess", "REPO", "descendants", "free_port", "pid_alive", "wait_for"]
