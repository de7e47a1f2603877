"""A private etcd for the one-machine cluster (`ftrain up`) and for tests."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path


class EtcdNotFound(RuntimeError):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now (etcd must not be given port 0; DESIGN.md)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def find_etcd() -> str:
    path = os.environ.get("FTRAIN_ETCD_BIN") or shutil.which("etcd")
    if not path:
        raise EtcdNotFound("no `etcd` binary on PATH; install it (`apt-get install -y etcd-server`) "
                           "or set FTRAIN_ETCD_BIN")
    return path


class EtcdProcess:
    """One etcd member on loopback with its own data directory; start() waits until it serves."""

    def __init__(self, data_dir: str | Path, client_port: int | None = None,
                 peer_port: int | None = None, host: str = "127.0.0.1", log_path: str | Path | None = None,
                 quota_backend_bytes: int = 2 * 1024**3):
        self.data_dir = Path(data_dir)
        self.quota_backend_bytes = quota_backend_bytes
        self.host = host
        self.client_port = client_port or free_port(host)
        self.peer_port = peer_port or free_port(host)
        self.log_path = Path(log_path) if log_path else self.data_dir.parent / "etcd.log"
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.client_port}"

    def start(self, timeout_s: float = 20.0) -> EtcdProcess:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.data_dir, 0o700)
        client = f"http://{self.host}:{self.client_port}"
        peer = f"http://{self.host}:{self.peer_port}"
        cmd = [
            find_etcd(), "--name", "ftrain", "--data-dir", str(self.data_dir),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"ftrain={peer}",
            # The leading control plane compacts by itself (service/compaction.py); this is
            # the backstop of a private etcd that no control plane uses for a while.
            "--auto-compaction-mode", "revision", "--auto-compaction-retention", "10000",
            "--quota-backend-bytes", str(self.quota_backend_bytes),
        ]
        log = open(self.log_path, "ab")  # noqa: SIM115 (kept open for the child's life)
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with code {self.proc.returncode}; see {self.log_path}")
            if self.is_healthy():
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"etcd did not become healthy within {timeout_s:g} s; see {self.log_path}")

    def is_healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoint}/health", timeout=1) as resp:
                return b'"true"' in resp.read()
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def kill(self) -> None:
        self.stop(signal.SIGKILL)
