"""A private etcd for the one-machine cluster (`ftrain up`) and for tests.

Given a root password, the etcd is closed, and it is never open where another local user
can connect. `start()` first runs it with its client URL a unix socket alone, in a
directory only this user may enter (`socket_dir`, 0700); through that socket it creates
etcd's `root` user with the password and turns etcd's authentication on (over etcd's HTTP
gateway, so this needs no gRPC), or, on a restart, finds it on and checks the password.
Then it checks that etcd holds no user but `root` and no role, and, where authentication
was still off, no key at all: anything else was put there by someone else (an etcd that
was once open) and the start is refused (`EtcdTampered`). Only then is etcd stopped and
started again on its TCP client port, where every request without credentials but /health
is refused ("user name is empty"). Doing this on every start costs one more start of etcd
(a lone member elects itself in a quarter of a second) and makes the checks hold before
anyone else can connect, whatever happened to the data directory in between.

Peers: with `peer_socket`, a member's peer URL is a unix socket in `socket_dir` too (the
members of `ftrain up`'s cluster share it). etcd's peer port has no authentication of its
own (only TLS with client certificates closes it): whoever reaches it can send raft
messages as a leader would, and so write anything. Tests that cut peer links in network
namespaces keep TCP peers.

Tests that do not care about authentication leave it off: it costs a few bcrypt rounds and
the extra start.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path


class EtcdNotFound(RuntimeError):
    pass


class EtcdRefused(RuntimeError):
    """etcd's gateway answered a request with an error (its message)."""


class EtcdTampered(RuntimeError):
    """A closed etcd holds what ftrain did not put there (users, roles, or keys written
    before its authentication was on)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now (etcd must not be given port 0: it would not say which it took)."""
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
GATEWAY_TIMEOUT_S = 10.0


class _UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP over a unix socket (etcd's gateway on its closed client socket).

    It connects through /proc/self/fd/N/NAME, N its directory opened O_PATH: a socket's
    path is limited to 108 bytes, and a test's directory alone can be longer.
    """

    def __init__(self, directory: Path, name: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._directory, self._name = directory, name

    def connect(self) -> None:
        fd = os.open(self._directory, os.O_PATH | os.O_DIRECTORY)
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            try:
                sock.connect(f"/proc/self/fd/{fd}/{self._name}")
            except OSError:
                sock.close()
                raise
            self.sock = sock
        finally:
            os.close(fd)


class EtcdProcess:
    """One etcd member with its own data directory; start() waits until it serves.

    With `root_password`, etcd's authentication is on and only its `root` user (that
    password) may use it; `auth_token_ttl_s` is how long etcd keeps an unused auth token
    (its --auth-token-ttl; 300 s by default). The module docstring says how it is closed
    before it listens on TCP.

    A member of a cluster of several (`ftrain up --etcd-members M`) is given its `name` and
    the whole `initial_cluster` ("name=peer URL,..."); such members are started together
    (`start_cluster`: a member serves only once a majority has met). A member restarted on
    its own (it rejoins) is `launch`ed and then waited for (`wait_serving`).
    """

    def __init__(self, data_dir: str | Path, client_port: int | None = None,
                 peer_port: int | None = None, host: str = "127.0.0.1", log_path: str | Path | None = None,
                 quota_backend_bytes: int = 2 * 1024**3, root_password: str | None = None,
                 auth_token_ttl_s: int | None = None, name: str = "ftrain",
                 initial_cluster: str | None = None, peer_socket: bool = False,
                 socket_dir: str | Path | None = None):
        self.data_dir = Path(data_dir).absolute()
        # etcd's unix sockets are named relative to its working directory (a URL's host:port
        # is its name); the members of a cluster share one, so that each reaches the others.
        self.socket_dir = Path(socket_dir).absolute() if socket_dir else self.data_dir.parent / "etcd-sockets"
        self.name = name
        self.initial_cluster = initial_cluster
        self.root_password = root_password
        self.auth_token_ttl_s = auth_token_ttl_s
        self.quota_backend_bytes = quota_backend_bytes
        self.host = host
        self.client_port = client_port or free_port(host)
        self.peer_socket = peer_socket
        self.peer_port = None if peer_socket else (peer_port or free_port(host))
        self.log_path = Path(log_path) if log_path else self.data_dir.parent / "etcd.log"
        self.proc: subprocess.Popen | None = None
        self.socket_only = False  # listening for clients on the unix socket alone

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.client_port}"

    @property
    def user(self) -> str | None:
        """The etcd user to connect as (None: authentication is off)."""
        return ROOT_USER if self.root_password is not None else None

    @property
    def peer_url(self) -> str:
        if self.peer_socket:
            return f"unix://{self.data_dir.name}.peer:0"
        return f"http://{self.host}:{self.peer_port}"

    @property
    def client_socket(self) -> Path:
        """The unix socket etcd listens on while it is being closed (before TCP)."""
        return self.socket_dir / f"{self.data_dir.name}.client:0"

    def start(self, timeout_s: float = 20.0) -> EtcdProcess:
        start_cluster([self], timeout_s)
        return self

    def launch(self, socket_only: bool = False) -> None:
        """Start the process without waiting for it to serve; with `socket_only`, its one
        client URL is the unix socket `client_socket` (see the module docstring)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.data_dir, 0o700)
        _private_dir(self.socket_dir)
        client = f"unix://{self.client_socket.name}" if socket_only else self.endpoint
        peer = self.peer_url
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
        if self.initial_cluster is None:
            # A lone member elects itself, but a restarted one only after a whole election
            # timeout (etcd's 1 s, randomized up to 2 s): paid twice by a closed start. With
            # no other member to hear from, a short one costs nothing.
            cmd += ["--heartbeat-interval", "50", "--election-timeout", "250"]
        if self.auth_token_ttl_s is not None:
            cmd += ["--auth-token-ttl", str(self.auth_token_ttl_s)]
        log = open(self.log_path, "ab")  # noqa: SIM115 (kept open for the child's life)
        self.socket_only = socket_only
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=self.socket_dir,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()

    def wait_serving(self, timeout_s: float = 20.0) -> EtcdProcess:
        """Wait until the member serves. Stops it and raises RuntimeError if it does not."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with code {self.proc.returncode}; see {self.log_path}")
            if self.is_healthy():
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"etcd did not become healthy within {timeout_s:g} s; see {self.log_path}")

    def _connection(self, timeout_s: float) -> http.client.HTTPConnection:
        if self.socket_only:
            return _UnixHTTPConnection(self.socket_dir, self.client_socket.name, timeout_s)
        return http.client.HTTPConnection(self.host, self.client_port, timeout=timeout_s)

    def _http(self, method: str, path: str, body: bytes | None = None,
              headers: dict[str, str] | None = None, timeout_s: float = 1.0) -> tuple[int, bytes]:
        conn = self._connection(timeout_s)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def is_healthy(self) -> bool:
        try:
            status, body = self._http("GET", "/health")
        except (OSError, http.client.HTTPException):
            return False
        return status == 200 and b'"true"' in body

    def _gateway(self, path: str, body: dict, token: str | None = None) -> dict:
        """POST `body` to etcd's v3 HTTP gateway; raise EtcdRefused with etcd's message."""
        headers = {"Authorization": token} if token else {}
        status, raw = self._http("POST", f"/v3/{path}", json.dumps(body).encode(), headers,
                                 GATEWAY_TIMEOUT_S)
        try:
            answer = json.loads(raw or b"{}")
        except ValueError:
            answer = {"message": raw.decode(errors="replace")}
        if status != 200:
            raise EtcdRefused(answer.get("message", f"HTTP {status}"))
        return answer

    def enable_auth(self) -> None:
        """Turn the cluster's authentication on through this member, unless it is on (then
        check the password); refuse an etcd that holds users or roles ftrain did not create."""
        assert self.root_password is not None
        self._refuse_foreign_principals(self._enable_auth(self.root_password))

    def _authenticate(self, password: str) -> str:
        """A token of root's (etcd hashes the password: each call costs a bcrypt round)."""
        return self._gateway("auth/authenticate", {"name": ROOT_USER, "password": password})["token"]

    def _enable_auth(self, password: str) -> str:
        """Create the root user with `password` and turn authentication on, unless it is on;
        a token of root's."""
        try:
            return self._authenticate(password)  # on already (a restart), and the password is right
        except EtcdRefused as exc:
            if "authentication is not enabled" not in str(exc):
                raise RuntimeError(
                    f"etcd in {self.data_dir} has authentication on but refuses the root password "
                    f"given ({exc}): was its password file replaced? Put the old one back, or "
                    f"start anew without {self.data_dir} (its jobs are lost)") from None
        self._refuse_keys_written_while_open()
        try:
            self._gateway("auth/user/add", {"name": ROOT_USER, "password": password})
        except EtcdRefused as exc:
            if "user name already exists" not in str(exc):  # an earlier start stopped half-way
                raise RuntimeError(f"could not create etcd's root user: {exc}") from None
            self._gateway("auth/user/changepw", {"name": ROOT_USER, "password": password})
        self._gateway("auth/user/grant", {"user": ROOT_USER, "role": "root"})
        self._gateway("auth/enable", {})
        return self._authenticate(password)

    def _refuse_keys_written_while_open(self) -> None:
        """Raise EtcdTampered if an etcd whose authentication is still off holds a key.

        Nothing of ftrain's writes to it before authentication is on (the control plane
        starts after), so a key there was written by whoever reached it open."""
        everything = {"key": "AA==", "range_end": "AA==", "count_only": True}  # base64 of b"\0"
        keys = int(self._gateway("kv/range", everything).get("count", 0))
        if keys:
            raise EtcdTampered(tampered_message(self.data_dir, f"{keys} key(s) written while its "
                                                               "authentication was off"))

    def _refuse_foreign_principals(self, token: str) -> None:
        """Raise EtcdTampered if etcd holds a user but root, or any role.

        ftrain creates the root user alone (its `root` role is built into etcd, never
        listed). Anything more was added by someone who reached etcd while it was open, and
        can read and write every job through it."""
        users = sorted(set(self._gateway("auth/user/list", {}, token).get("users", [])) - {ROOT_USER})
        roles = sorted(self._gateway("auth/role/list", {}, token).get("roles", []))
        if users or roles:
            found = "; ".join(f"{what} {', '.join(names)}" for what, names in
                              (("users", users), ("roles", roles)) if names)
            raise EtcdTampered(tampered_message(self.data_dir, found))

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


def _private_dir(path: Path) -> None:
    """Make `path` a directory of this user's alone (0700), or refuse one that is another's."""
    path.mkdir(mode=0o700, exist_ok=True)
    if path.stat().st_uid != os.geteuid():
        raise RuntimeError(f"{path} belongs to another user; etcd's sockets must be in a directory "
                           "of yours alone: remove it, or give etcd another data directory")
    os.chmod(path, 0o700)


def tampered_message(data_dir: Path, found: str) -> str:
    return (f"etcd in {data_dir} holds what ftrain did not put there ({found}): ftrain creates only "
            f"the user {ROOT_USER!r}, and writes nothing before etcd's authentication is on. Someone "
            "who reached this etcd while it was open (an older ftrain left it open at its first "
            "start) may have given themselves a way in or planted records (a user, a token, a job). "
            "etcd was stopped and nothing else was started. Keep the directory for inspection and "
            "start anew with another --data-dir (its jobs are not carried over); if you added them "
            "yourself, run etcd on that data directory yourself and delete them (`etcdctl --user "
            f"{ROOT_USER} user delete NAME`, `role delete NAME`, `del KEY`; the password is in the "
            "data directory's etcd-password).")


def _close_members(members: list[EtcdProcess], timeout_s: float) -> None:
    """Authentication on and no foreign user or role, checked while the members listen for
    clients on their unix sockets alone; then stopped (to listen on TCP)."""
    for member in members:
        member.launch(socket_only=True)
    for member in members:
        member.wait_serving(timeout_s)
    members[0].enable_auth()  # etcd replicates it to the others
    for member in members:
        member.stop()


def start_cluster(members: list[EtcdProcess], timeout_s: float = 30.0) -> None:
    """Start the members of one etcd cluster (one or several) and wait until all serve.

    All are launched first (a member serves only once a majority has met). Members with a
    root password are closed first, on their unix sockets (module docstring). On failure
    every member is stopped.
    """
    try:
        if members[0].root_password is not None:
            _close_members(members, timeout_s)
        for member in members:
            member.launch()
        for member in members:
            member.wait_serving(timeout_s)
    except BaseException:
        for member in members:
            member.stop()
        raise


def cluster_endpoints(members: list[EtcdProcess]) -> str:
    """The members' client URLs, comma-separated (the control plane's --etcd)."""
    return ",".join(member.endpoint for member in members)
