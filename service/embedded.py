"""A private etcd for the one-machine cluster (`ftrain up`) and for tests.

Given a root password, the etcd is closed: `start()` creates etcd's `root` user with that
password and turns etcd's authentication on (over etcd's HTTP gateway, so this needs no
gRPC), once; a restart on the same data directory finds it on and checks the password.
Without credentials every request but /health is then refused ("user name is empty"), so
another local user who finds the port reads and writes nothing. Tests that do not care
about authentication leave it off: it costs a few bcrypt rounds per start.
"""

from __future__ import annotations

import json
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


class EtcdRefused(RuntimeError):
    """etcd's gateway answered a request with an error (its message)."""


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


ROOT_USER = "root"


class EtcdProcess:
    """One etcd member on loopback with its own data directory; start() waits until it serves.

    With `root_password`, etcd's authentication is on and only its `root` user (that
    password) may use it; `auth_token_ttl_s` is how long etcd keeps an unused auth token
    (its --auth-token-ttl; 300 s by default).

    A member of a cluster of several (`ftrain up --etcd-members M`) is given its `name` and
    the whole `initial_cluster` ("name=peer URL,..."); such members are `launch`ed together
    and then waited for (`wait_serving`: a member serves once a majority has met), and
    authentication is turned on through one of them (`enable_auth`; etcd replicates it).
    """

    def __init__(self, data_dir: str | Path, client_port: int | None = None,
                 peer_port: int | None = None, host: str = "127.0.0.1", log_path: str | Path | None = None,
                 quota_backend_bytes: int = 2 * 1024**3, root_password: str | None = None,
                 auth_token_ttl_s: int | None = None, name: str = "ftrain",
                 initial_cluster: str | None = None):
        self.data_dir = Path(data_dir)
        self.name = name
        self.initial_cluster = initial_cluster
        self.root_password = root_password
        self.auth_token_ttl_s = auth_token_ttl_s
        self.quota_backend_bytes = quota_backend_bytes
        self.host = host
        self.client_port = client_port or free_port(host)
        self.peer_port = peer_port or free_port(host)
        self.log_path = Path(log_path) if log_path else self.data_dir.parent / "etcd.log"
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.client_port}"

    @property
    def user(self) -> str | None:
        """The etcd user to connect as (None: authentication is off)."""
        return ROOT_USER if self.root_password is not None else None

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    def start(self, timeout_s: float = 20.0) -> EtcdProcess:
        self.launch()
        return self.wait_serving(timeout_s, enable_auth=True)

    def launch(self) -> None:
        """Start the process without waiting for it to serve."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.data_dir, 0o700)
        client = f"http://{self.host}:{self.client_port}"
        peer = f"http://{self.host}:{self.peer_port}"
        cmd = [
            find_etcd(), "--name", self.name, "--data-dir", str(self.data_dir),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", self.initial_cluster or f"{self.name}={peer}",
            # The leading control plane compacts by itself (service/compaction.py); this is
            # the backstop of a private etcd that no control plane uses for a while.
            "--auto-compaction-mode", "revision", "--auto-compaction-retention", "10000",
            "--quota-backend-bytes", str(self.quota_backend_bytes),
        ]
        if self.auth_token_ttl_s is not None:
            cmd += ["--auth-token-ttl", str(self.auth_token_ttl_s)]
        log = open(self.log_path, "ab")  # noqa: SIM115 (kept open for the child's life)
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()

    def wait_serving(self, timeout_s: float = 20.0, enable_auth: bool = True) -> EtcdProcess:
        """Wait until the member serves; then turn authentication on (if a root password is
        given and `enable_auth`). Stops the member and raises RuntimeError if it does not."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with code {self.proc.returncode}; see {self.log_path}")
            if self.is_healthy():
                if self.root_password is not None and enable_auth:
                    try:
                        self._enable_auth(self.root_password)
                    except RuntimeError:
                        self.stop()
                        raise
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

    def _gateway(self, path: str, body: dict) -> dict:
        """POST `body` to etcd's v3 HTTP gateway; raise EtcdRefused with etcd's message."""
        request = urllib.request.Request(f"{self.endpoint}/v3/{path}", data=json.dumps(body).encode(),
                                         method="POST")
        try:
            with urllib.request.urlopen(request, timeout=10) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read()).get("message", str(exc))
            except ValueError:
                message = str(exc)
            raise EtcdRefused(message) from None

    def enable_auth(self) -> None:
        """Turn the cluster's authentication on through this member (see `_enable_auth`)."""
        assert self.root_password is not None
        self._enable_auth(self.root_password)

    def _enable_auth(self, password: str) -> None:
        """Create the root user with `password` and turn authentication on, unless it is on."""
        try:
            self._gateway("auth/authenticate", {"name": ROOT_USER, "password": password})
            return  # on already (a restart), and the password is right
        except EtcdRefused as exc:
            if "authentication is not enabled" not in str(exc):
                raise RuntimeError(
                    f"etcd in {self.data_dir} has authentication on but refuses the root password "
                    f"given ({exc}): was its password file replaced? Put the old one back, or "
                    f"start anew without {self.data_dir} (its jobs are lost)") from None
        try:
            self._gateway("auth/user/add", {"name": ROOT_USER, "password": password})
        except EtcdRefused as exc:
            if "user name already exists" not in str(exc):  # an earlier start stopped half-way
                raise RuntimeError(f"could not create etcd's root user: {exc}") from None
            self._gateway("auth/user/changepw", {"name": ROOT_USER, "password": password})
        self._gateway("auth/user/grant", {"user": ROOT_USER, "role": "root"})
        self._gateway("auth/enable", {})

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


def start_cluster(members: list[EtcdProcess], timeout_s: float = 30.0) -> None:
    """Start the members of one etcd cluster (one or several) and wait until all serve.

    All are launched first (a member serves only once a majority has met); authentication,
    if the members have a root password, is turned on through the first one (etcd
    replicates it) and then checked on each. On failure every member is stopped.
    """
    try:
        for member in members:
            member.launch()
        for member in members:
            member.wait_serving(timeout_s, enable_auth=False)
        if members[0].root_password is not None:
            members[0].enable_auth()
            for member in members[1:]:
                member.wait_serving(timeout_s, enable_auth=True)  # the password, on each
    except BaseException:
        for member in members:
            member.stop()
        raise


def cluster_endpoints(members: list[EtcdProcess]) -> str:
    """The members' client URLs, comma-separated (the control plane's --etcd)."""
    return ",".join(member.endpoint for member in members)
