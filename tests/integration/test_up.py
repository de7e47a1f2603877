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
from pathlib import Path

import httpx
import pytest

from service.up import agent_available, choose_etcd_ports, curl_lines, ensure_token
from tests.helpers.other_user import everything_under, needs_root, probe_as_other_user
from tests.helpers.processes import REPO, descendants, free_port, pid_alive, stop_tree, wait_for

BANNER_END = "Ctrl-C stops everything."
FALLBACK_SPEC = {"name": "example", "command": ["python", "examples/train.py"]}


class Up:
    """One `ftrain up` child process, its output kept in a file."""

    def __init__(self, data_dir: Path, port: int, nodes: int = 0, extra: tuple[str, ...] = ()):
        self.data_dir, self.port, self.nodes, self.extra = data_dir, port, nodes, list(extra)
        self.out_path = data_dir.parent / f"up-{port}-{os.urandom(3).hex()}.out"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60) -> Up:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FTRAIN_")}
        with open(self.out_path, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "service.cli", "up", "--port", str(self.port),
                 "--data-dir", str(self.data_dir), "--nodes", str(self.nodes), *self.extra],
                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wait_for(self._banner_printed, timeout_s, "`ftrain up` to print its banner")
        return self

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
              extra: tuple[str, ...] = ()) -> Up:
        up = Up(data_dir or tmp_path / "data", port or free_port(), nodes, extra)
        started.append(up)
        return up.start()

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


def test_etcd_ports_are_reused_while_free(tmp_path):
    path = tmp_path / "etcd-ports"
    ports = choose_etcd_ports(path)
    assert choose_etcd_ports(path) == ports
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", ports[0]))
        busy.listen()
        new = choose_etcd_ports(path)
    assert new != ports and new[0] != ports[0]
    assert json.loads(path.read_text()) == {"client": new[0], "peer": new[1]}


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
