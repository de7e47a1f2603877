"""`ftrain up` as a real subprocess: data directory, printed curl lines, restart, clean shutdown."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import httpx
import pytest

from service.embedded import ROOT_USER, EtcdProcess
from service.up import UpError, agent_available, choose_cluster_ports, choose_etcd_port, curl_lines, ensure_token
from service.up import is_port_free
from tests.helpers.other_user import everything_under, needs_root, probe_as_other_user, start_etcd_intruder
from tests.helpers.processes import REPO, descendants, free_port, pid_alive, stop_tree, wait_for
from tests.helpers.processes import tcp_ports_listened_on

BANNER_END = "Ctrl-C stops everything."
FALLBACK_SPEC = {"name": "example", "command": ["python", "examples/train.py"]}


class Up:
    """One `ftrain up` child process, its output kept in a file."""

    def __init__(self, data_dir: Path, port: int, nodes: int = 0, extra: tuple[str, ...] = ()):
        self.data_dir, self.port, self.nodes, self.extra = data_dir, port, nodes, list(extra)
        self.out_path = data_dir.parent / f"up-{port}-{os.urandom(3).hex()}.out"
        self.proc: subprocess.Popen | None = None

    def launch(self) -> Up:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FTRAIN_")}
        with open(self.out_path, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "service.cli", "up", "--port", str(self.port),
                 "--data-dir", str(self.data_dir), "--nodes", str(self.nodes), *self.extra],
                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        return self

    def start(self, timeout_s: float = 60) -> Up:
        self.launch()
        wait_for(self._banner_printed, timeout_s, "`ftrain up` to print its banner")
        return self

    def refused(self, timeout_s: float = 90) -> int:
        """Launch `up` expecting it to give up before it serves; its exit code."""
        assert self.launch().proc is not None
        wait_for(lambda: self.proc.poll() is not None or BANNER_END in self.output(), timeout_s,
                 "`ftrain up` to exit")
        assert BANNER_END not in self.output(), f"`ftrain up` started:\n{self.output()}"
        return self.proc.returncode

    def output(self) -> str:
        return self.out_path.read_text()

    def _banner_printed(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"`ftrain up` exited with {self.proc.returncode}:\n{self.output()}")
        return BANNER_END in self.output()

    def interrupt(self, timeout_s: float = 60) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(timeout_s)

    def kill(self) -> None:
        """Test clean-up: the `up` process, and whatever it left, all started by this test."""
        if self.proc is None:
            return
        stop_tree(self.proc, signal.SIGTERM, 30)


@pytest.fixture
def start_up(tmp_path):
    started: list[Up] = []

    def start(data_dir: Path | None = None, port: int | None = None, nodes: int = 0,
              extra: tuple[str, ...] = (), launch: bool = True, tries: int = 3) -> Up:
        up = Up(data_dir or tmp_path / "data", port or free_port(), nodes, extra)
        started.append(up)
        if not launch:
            return up
        try:
            return up.start()
        except AssertionError as exc:
            # A port the test chose free was taken by another process before `up` bound it
            # (tests run side by side): the test's race, not `up`'s; again on another.
            if port is not None or tries == 1 or "address already in use" not in str(exc):
                raise
            up.kill()
            return start(data_dir, port, nodes, extra, launch, tries - 1)

    yield start
    for up in started:
        up.kill()


def submit_line(output: str) -> str:
    lines = [ln.strip() for ln in output.splitlines() if ln.strip().startswith("curl -sS -X POST")
             and ln.strip().split()[4].endswith("/v1/jobs")]
    assert len(lines) == 1, output
    return lines[0]


def run_curl_with_httpx(line: str, cwd: Path, job_id: str | None = None,
                        token: str | None = None) -> httpx.Response:
    """Do what a printed curl line does (method, URL, headers, --data @file) with httpx, with
    $JOB and $TOKEN as the shell would have them."""
    if job_id is not None:
        line = line.replace("$JOB", job_id)
    if token is not None:
        line = line.replace("$TOKEN", token)
    argv = shlex.split(line)
    assert argv[0] == "curl"
    method, url, headers, body = "GET", None, {}, None
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "-X":
            method, i = argv[i + 1], i + 2
        elif arg == "-H":
            name, value = argv[i + 1].split(":", 1)
            headers[name.strip()] = value.strip()
            i += 2
        elif arg == "--data":
            path = cwd / argv[i + 1].removeprefix("@")
            # The example job is another part's file; the line's shape is what is tested here.
            body = path.read_bytes() if path.exists() else json.dumps(FALLBACK_SPEC).encode()
            method = "POST" if method == "GET" else method
            i += 2
        elif arg.startswith("-"):
            i += 1
        else:
            url, i = arg, i + 1
    assert url is not None, line
    return httpx.request(method, url, headers=headers, content=body, timeout=10)


def test_up_writes_private_tokens_and_its_printed_curl_lines_work(start_up, tmp_path):
    up = start_up()
    data = up.data_dir
    for name in ("token", "node-token"):
        assert stat.S_IMODE((data / name).stat().st_mode) == 0o600, name
    token = (data / "token").read_text().strip()
    node_token = (data / "node-token").read_text().strip()
    assert token and node_token and token != node_token
    url = f"http://127.0.0.1:{up.port}"
    assert (data / "server").read_text().strip() == url

    output = up.output()
    assert token not in output and node_token not in output  # no secret in the terminal's scrollback
    read = [ln.strip() for ln in output.splitlines() if ln.strip().startswith("TOKEN=$(cat ")]
    assert len(read) == 1, output
    token_file = shlex.split(read[0].removeprefix("TOKEN=$(cat ").removesuffix(")"))[0]
    assert (Path(token_file) if Path(token_file).is_absolute() else Path.cwd() / token_file).resolve() \
        == (data / "token").resolve()
    line = submit_line(output)
    assert url in line and "Authorization: Bearer $TOKEN" in line
    resp = run_curl_with_httpx(line, REPO, token=token)
    assert resp.status_code == 201, resp.text
    job_id = resp.json()["id"]

    rest = [ln.strip() for ln in output.splitlines() if ln.strip().startswith("curl") and "$JOB" in ln]
    assert len(rest) == 4, output
    status = run_curl_with_httpx(next(ln for ln in rest if "/v1/jobs/$JOB -H" in ln), REPO, job_id, token)
    assert status.status_code == 200 and status.json()["id"] == job_id
    events = run_curl_with_httpx(next(ln for ln in rest if "/events" in ln), REPO, job_id, token)
    assert [e["state"] for e in events.json()["items"]] == ["PENDING"]
    cancel = run_curl_with_httpx(next(ln for ln in rest if "/cancel" in ln), REPO, job_id, token)
    assert cancel.status_code == 202 and cancel.json()["state"] == "CANCELLED"

    assert up.interrupt() == 0


def test_restarted_up_keeps_tokens_ports_and_jobs(start_up, tmp_path):
    first = start_up()
    token = (first.data_dir / "token").read_text().strip()
    ports = json.loads((first.data_dir / "etcd-ports").read_text())
    url = f"http://127.0.0.1:{first.port}"
    headers = {"Authorization": f"Bearer {token}"}
    job = httpx.post(f"{url}/v1/jobs", json=FALLBACK_SPEC, headers=headers, timeout=10).json()
    assert first.interrupt() == 0

    second = start_up(first.data_dir, first.port)
    assert (second.data_dir / "token").read_text().strip() == token
    assert json.loads((second.data_dir / "etcd-ports").read_text()) == ports
    got = httpx.get(f"{url}/v1/jobs/{job['id']}", headers=headers, timeout=10)
    assert got.status_code == 200 and got.json()["name"] == FALLBACK_SPEC["name"]
    assert second.interrupt() == 0


def test_sigint_stops_every_process_up_started(start_up):
    up = start_up()
    assert up.proc is not None
    children = descendants(up.proc.pid)
    assert len(children) >= 2, children  # etcd and the control plane at least
    assert up.interrupt() == 0
    assert "stopped." in up.output()
    wait_for(lambda: not any(pid_alive(p) for p in children), 10, "every child of `up` to be gone")


@pytest.mark.integration
@pytest.mark.skipif(not agent_available(), reason="the node agent (worker/agent.py) is not in this build")
def test_up_with_nodes_registers_them_and_sigint_stops_the_agents_too(start_up):
    up = start_up(nodes=2, port=free_port())
    assert "local nodes registered: local-0, local-1" in up.output(), up.output()
    token = (up.data_dir / "token").read_text().strip()
    nodes = httpx.get(f"http://127.0.0.1:{up.port}/v1/nodes",
                      headers={"Authorization": f"Bearer {token}"}, timeout=10).json()["items"]
    assert {n["name"] for n in nodes} == {"local-0", "local-1"}
    assert up.proc is not None
    children = descendants(up.proc.pid)
    # The agents read the node token from its file: it is in no agent's argv or environment.
    node_token = (up.data_dir / "node-token").read_text().strip().encode()
    agents = [p for p in children if b"node" in _proc_file(p, "cmdline").split(b"\0")]
    assert len(agents) == 2
    for pid in agents:
        assert node_token not in _proc_file(pid, "cmdline") + _proc_file(pid, "environ")
    assert up.interrupt() == 0
    wait_for(lambda: not any(pid_alive(p) for p in children), 10, "every agent, control plane and etcd")


def _proc_file(pid: int, name: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:
        return b""


def test_a_second_up_on_the_same_data_dir_is_refused(start_up, tmp_path):
    up = start_up()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTRAIN_")}
    other = subprocess.run([sys.executable, "-m", "service.cli", "up", "--port", str(free_port()),
                            "--data-dir", str(up.data_dir), "--nodes", "0"],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert other.returncode == 1
    assert "another `ftrain up` is running with the data directory" in other.stdout
    assert up.interrupt() == 0


def test_up_on_a_busy_port_says_so(start_up, tmp_path):
    up = start_up()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTRAIN_")}
    other = subprocess.run([sys.executable, "-m", "service.cli", "up", "--port", str(up.port),
                            "--data-dir", str(tmp_path / "other"), "--nodes", "0"],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert other.returncode == 1 and f"port {up.port} on 127.0.0.1 is in use" in other.stdout
    assert up.interrupt() == 0


def test_tokens_are_created_once_with_mode_0600(tmp_path):
    path = tmp_path / "token"
    token = ensure_token(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.chmod(0o644)
    assert ensure_token(path) == token
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_etcd_port_is_reused_while_free(tmp_path):
    path = tmp_path / "etcd-ports"
    port = choose_etcd_port(path)
    assert choose_etcd_port(path) == port
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        new = choose_etcd_port(path)
    assert new != port
    assert json.loads(path.read_text()) == {"client": new}


def test_a_cluster_whose_members_talk_over_tcp_peer_ports_is_refused(tmp_path):
    """A cluster made with TCP peer ports (open to every local user) is not started again."""
    path = tmp_path / "etcd-ports"
    path.write_text(json.dumps({"members": [{"client": 1, "peer": 2}, {"client": 3, "peer": 4},
                                            {"client": 5, "peer": 6}]}))
    with pytest.raises(UpError, match="talk over TCP peer ports.*another --data-dir"):
        choose_cluster_ports(path, 3)
    fresh = tmp_path / "fresh-ports"
    ports = choose_cluster_ports(fresh, 3)
    assert json.loads(fresh.read_text()) == {"members": [{"client": p} for p in ports]}
    assert choose_cluster_ports(fresh, 3) == ports


def test_curl_lines_read_the_token_from_its_file_and_name_the_example_job():
    lines = curl_lines("http://127.0.0.1:8000", "my data/token", "examples/job.json")
    assert lines[0] == "TOKEN=$(cat 'my data/token')"
    assert lines[2] == ("curl -sS -X POST http://127.0.0.1:8000/v1/jobs -H \"Authorization: Bearer $TOKEN\" "
                        "-H 'Content-Type: application/json' --data @examples/job.json")
    assert sum("$JOB" in ln for ln in lines) == 4


def test_readme_shows_the_curl_lines_up_prints():
    readme = (REPO / "README.md").read_text()
    for line in curl_lines("http://127.0.0.1:8000", ".ftrain/token", "examples/job.json"):
        assert line in readme.splitlines(), line


def test_the_banners_cli_lines_name_an_ftrain_that_runs(tmp_path, monkeypatch):
    from service.up import cli_command

    venv_bin = tmp_path / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    script = venv_bin / "ftrain"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # not on PATH, as under `make up`
    assert cli_command(str(script), cwd=tmp_path) == ".venv/bin/ftrain"
    monkeypatch.setenv("PATH", f"{venv_bin}:/usr/bin:/bin")
    assert cli_command(str(script), cwd=tmp_path) == "ftrain"


@pytest.fixture
def open_base():
    """A directory any local user may enter (pytest's tmp_path is root's alone, which would
    hide what ftrain's own modes do); removed afterwards."""
    base = Path(tempfile.mkdtemp(prefix="ftrain-closed-", dir="/tmp"))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.mark.integration
@needs_root()
@pytest.mark.skipif(not agent_available(), reason="the node agent (worker/agent.py) is not in this build")
def test_another_local_user_reads_no_file_of_up_and_nothing_from_its_etcd(start_up, open_base):
    """After a job ran (logs, worker output, snapshots written), `nobody` can read no file
    and list no directory under the data directory, and etcd refuses it every request."""
    up = start_up(data_dir=open_base / "data", nodes=1)
    data = up.data_dir
    url = f"http://127.0.0.1:{up.port}"
    headers = {"Authorization": f"Bearer {(data / 'token').read_text().strip()}"}
    spec = {"name": "closed", "command": ["python", "examples/train.py", "--steps", "12"],
            "nodes": {"min": 1, "max": 1}, "snapshot": {"every_steps": 5, "keep": 2}}
    job = httpx.post(f"{url}/v1/jobs", json=spec, headers=headers, timeout=10).json()
    done = wait_for(lambda: (j := httpx.get(f"{url}/v1/jobs/{job['id']}", headers=headers,
                                            timeout=10).json())["state"] in ("SUCCEEDED", "FAILED") and j,
                    120, "the job to end")
    assert done["state"] == "SUCCEEDED", done
    assert done["progress"]["step"] == 12, done  # rank 0's final report: the step it ended at
    assert done["latest_snapshot"] is not None
    snapshots = list((data / "snapshots" / job["id"]).glob("*.pt"))
    assert snapshots and list((data / "job-logs" / job["id"]).iterdir())
    assert list((data / "logs" / job["id"]).iterdir())  # the agent's copy of torchrun's output

    paths = everything_under(data)
    loose = [(str(p), oct(stat.S_IMODE(p.lstat().st_mode))) for p in paths
             if stat.S_IMODE(p.lstat().st_mode) & 0o077 and not p.is_symlink()]
    assert not loose, loose  # no file, no directory open to group or others

    etcd_port = json.loads((data / "etcd-ports").read_text())["client"]
    etcd = f"http://127.0.0.1:{etcd_port}"
    seen = probe_as_other_user(paths, [
        (f"{etcd}/v3/kv/range", json.dumps({"key": "AA==", "range_end": "AA=="})),  # every key
        (f"{etcd}/v3/kv/put", json.dumps({"key": "L2Z0cmFpbi94", "value": "eA=="})),
        (f"{etcd}/v3/auth/authenticate", json.dumps({"name": "root", "password": ""})),
    ])
    readable = [p for p, got in seen["paths"].items() if got == "read"]
    assert not readable, readable
    assert set(seen["paths"].values()) == {"PermissionError"}, seen["paths"]
    for url_, (status, body) in seen["posts"].items():
        assert status == 400 and ("user name is empty" in body or "authentication failed" in body), \
            (url_, status, body)
    assert up.interrupt() == 0


def gateway(endpoint: str, path: str, body: dict, token: str | None = None) -> dict:
    """POST to etcd's v3 HTTP gateway (as a token's user, or as nobody in particular)."""
    request = urllib.request.Request(f"{endpoint}/v3/{path}", data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": token} if token else {})
    with urllib.request.urlopen(request, timeout=10) as resp:
        return json.loads(resp.read())


def root_token(endpoint: str, data_dir: Path) -> str:
    password = (data_dir / "etcd-password").read_text().strip()
    return gateway(endpoint, "auth/authenticate", {"name": ROOT_USER, "password": password})["token"]


def etcd_principals(data_dir: Path) -> tuple[list[str], list[str]]:
    """The users and roles in the etcd of a running `up` (asked as its root)."""
    endpoint = f"http://127.0.0.1:{json.loads((data_dir / 'etcd-ports').read_text())['client']}"
    token = root_token(endpoint, data_dir)
    return (gateway(endpoint, "auth/user/list", {}, token).get("users", []),
            gateway(endpoint, "auth/role/list", {}, token).get("roles", []))


@pytest.mark.integration
@needs_root()
def test_no_other_local_user_can_add_an_etcd_user_or_write_a_key_during_the_first_start(start_up, tmp_path):
    """From before etcd listens until `up` serves, `nobody` keeps trying etcd's client port
    (add a user, grant it root, add a role, write a key, without credentials) and its peer port."""
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    client, peer = free_port(), free_port()
    # The ports `up` would pick, chosen here so that the intruder knows them from the start
    # (a real one watches /proc/net/tcp); an older data directory kept both.
    (data / "etcd-ports").write_text(json.dumps({"client": client, "peer": peer}))
    intruder = start_etcd_intruder(client, peer, answers=40, deadline_s=120)
    try:
        up = start_up(data_dir=data)
        out, err = intruder.communicate(timeout=150)
    finally:
        if intruder.poll() is None:
            intruder.kill()
            intruder.wait()
    seen = json.loads(out.splitlines()[-1])
    assert json.loads((data / "etcd-ports").read_text())["client"] == client  # the port it tried
    assert seen["accepted"] == [], seen
    assert seen["answers"] >= 40, (seen, err)  # it reached etcd, and was refused every time
    assert "user name is empty" in seen["first_answer"], seen
    assert seen["peer_connects"] == 0, seen
    assert etcd_principals(data) == ([ROOT_USER], [])
    assert up.interrupt() == 0


def test_up_s_etcd_listens_on_tcp_for_its_clients_alone_and_keeps_it_across_restarts(start_up, tmp_path):
    """Its peer traffic stays on a unix socket in the 0700 data directory; a restart (etcd
    closed again on its socket, then on TCP) serves the same client port and the jobs."""
    first = start_up()
    data = first.data_dir
    client = json.loads((data / "etcd-ports").read_text())["client"]
    etcd_pid = int((data / "etcd.pid").read_text())
    assert tcp_ports_listened_on(etcd_pid) == [client]
    assert stat.S_IMODE((data / "etcd-sockets").stat().st_mode) == 0o700
    token = (data / "token").read_text().strip()
    url, headers = f"http://127.0.0.1:{first.port}", {"Authorization": f"Bearer {token}"}
    job = httpx.post(f"{url}/v1/jobs", json=FALLBACK_SPEC, headers=headers, timeout=10).json()
    assert first.interrupt() == 0

    second = start_up(data, first.port)
    assert tcp_ports_listened_on(int((data / "etcd.pid").read_text())) == [client]
    assert httpx.get(f"{url}/v1/jobs/{job['id']}", headers=headers, timeout=10).status_code == 200
    assert etcd_principals(data) == ([ROOT_USER], [])
    assert second.interrupt() == 0


def _user_added_while_open(data: Path) -> None:
    """What an intruder did to an etcd that was open at its first start: a user with root."""
    etcd = EtcdProcess(data / "etcd", log_path=data / "seed.log").start()  # open: no password
    try:
        gateway(etcd.endpoint, "auth/user/add", {"name": "intruder", "password": "intruder-pw"})
        gateway(etcd.endpoint, "auth/user/grant", {"user": "intruder", "role": "root"})
    finally:
        etcd.stop()


def _key_written_while_open(data: Path) -> None:
    """What an intruder did to an etcd that was open at its first start: a planted record."""
    etcd = EtcdProcess(data / "etcd", log_path=data / "seed.log").start()  # open: no password
    try:
        gateway(etcd.endpoint, "kv/put", {"key": "L2Z0cmFpbi91c2Vycy9pbnRydWRlcg==", "value": "e30="})
    finally:
        etcd.stop()


def _role_added_later(data: Path) -> None:
    """A role added by whoever had etcd's root password, after a normal first start."""
    password = (data / "etcd-password").read_text().strip()
    etcd = EtcdProcess(data / "etcd", log_path=data / "seed.log", root_password=password).start()
    try:
        gateway(etcd.endpoint, "auth/role/add", {"name": "reader"}, root_token(etcd.endpoint, data))
    finally:
        etcd.stop()


@pytest.mark.parametrize("seed, found", [
    (_user_added_while_open, "users intruder"),
    (_key_written_while_open, "1 key(s) written while its authentication was off"),
    (_role_added_later, "roles reader")])
def test_up_refuses_an_etcd_holding_users_roles_or_keys_it_did_not_put_there(start_up, tmp_path, seed, found):
    data = tmp_path / "data"
    if seed is _role_added_later:
        assert start_up(data_dir=data).interrupt() == 0
    else:
        data.mkdir(mode=0o700)
    seed(data)

    up = start_up(data_dir=data, launch=False)
    assert up.refused() == 1, up.output()
    output = up.output()
    assert f"holds what ftrain did not put there ({found})" in output, output
    assert "another --data-dir" in output and "user delete NAME" in output
    client = json.loads((data / "etcd-ports").read_text())["client"]
    assert is_port_free(client)  # etcd never listened on TCP, and nothing was left running
