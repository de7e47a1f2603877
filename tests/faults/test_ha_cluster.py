"""Faults on the local HA cluster: `ftrain up --replicas 2 --etcd-members 3` as
real processes, a real two-node job on its agents.

- The leading control plane is SIGKILLed mid-job: the job trains on (0 restarts, 0 steps
  lost), a replica takes the lead (the survivor, or the killed one that `up` starts again) and schedules a job submitted at the kill (the
  time from the kill to that job's start is printed), and a node started during the outage
  joins and is given work. Then etcd's leading member is SIGKILLed: nothing is noticed (every
  read answered meanwhile, a job submitted at the kill runs, the first job loses nothing).
- Rolling restart (the same layout built from its parts): each control plane and each etcd
  member in turn is stopped and started again while a job trains: 0 restarts, 0 steps lost.

Minutes each: marked `slow` and left out of the default run (FTRAIN_TEST_SLOW=1 runs them).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from service.client import FtrainClient
from service.embedded import EtcdProcess, cluster_endpoints, start_cluster
from service.up import is_port_free
from tests.helpers.elastic import job, submit, wait_nodes, wait_state
from tests.helpers.faults import SnapshotWatch, check_steps, events_of, latest_step, train_spec, wait_latest
from tests.helpers.processes import (
    REPO,
    ControlPlane,
    NodeAgentProc,
    descendants,
    free_port,
    pid_alive,
    stop_tree,
    wait_for,
)

pytestmark = [
    pytest.mark.integration, pytest.mark.slow,
    pytest.mark.skipif(not os.environ.get("FTRAIN_TEST_SLOW"),
                       reason="slow (minutes): set FTRAIN_TEST_SLOW=1 to run it"),
]

BANNER_END = "Ctrl-C stops everything."


def _argv(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


class UpCluster:
    """One `ftrain up --replicas 2 --etcd-members 3` child; what the helpers need of a control
    plane (`url`, `node_token_file`, `client()`), over the replica that is alive."""

    def __init__(self, tmp: Path, nodes: int):
        self.data_dir = tmp / "data"
        self.port = wait_for(lambda: (p := free_port()) and is_port_free(p + 1) and p, 5,
                             "two free ports side by side")
        self.urls = [f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{self.port + 1}"]
        self.server = ",".join(self.urls)
        self.out_path = tmp / "up.out"
        env = {k: v for k, v in os.environ.items() if not k.startswith("FTRAIN_")}
        with open(self.out_path, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "service.cli", "up", "--port", str(self.port), "--data-dir",
                 str(self.data_dir), "--nodes", str(nodes), "--replicas", "2", "--etcd-members", "3"],
                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wait_for(self._banner, 120, "`ftrain up` to print its banner")
        self.user_token = (self.data_dir / "token").read_text().strip()
        self.node_token_file = self.data_dir / "node-token"
        self.url = self.urls[1]  # changed by a test to a replica that is alive

    def _banner(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"`ftrain up` exited:\n{self.out_path.read_text()}")
        return BANNER_END in self.out_path.read_text()

    def client(self, url: str | None = None) -> httpx.Client:
        return httpx.Client(base_url=url or self.url, timeout=10,
                            headers={"Authorization": f"Bearer {self.user_token}"})

    def replica_pid(self, url: str) -> int:
        port = url.rsplit(":", 1)[1].encode()
        pids = [p for p in descendants(self.proc.pid)
                if b"serve" in _argv(p) and port in _argv(p) and pid_alive(p)]
        assert len(pids) == 1, pids
        return pids[0]

    def etcd_pids(self) -> list[int]:
        return [p for p in descendants(self.proc.pid)
                if _argv(p) and Path(_argv(p)[0].decode()).name == "etcd" and pid_alive(p)]

    def etcd_leader_pid(self) -> int:
        """The etcd member that leads its cluster (etcd's own /metrics says so)."""
        def leads(pid: int) -> bool:
            argv = [a.decode() for a in _argv(pid)]
            url = argv[argv.index("--listen-client-urls") + 1].split(",")[0]
            text = httpx.get(f"{url}/metrics", timeout=5).text
            return "\netcd_server_is_leader 1" in text
        return wait_for(lambda: ([p for p in self.etcd_pids() if leads(p)] or [None])[0], 10,
                        "an etcd member to lead")

    def leader(self) -> str:
        """The replica whose scheduler passes: its pass count grows (GET /metrics)."""
        def passes() -> dict[str, float]:
            out = {}
            for url in self.urls:
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    text = httpx.get(f"{url}/metrics", timeout=5).text
                    out[url] = sum(float(line.split()[-1]) for line in text.splitlines()
                                   if line.startswith("ftrain_scheduler_pass_seconds_count"))
            return out

        def grows() -> str | None:
            first = passes()
            time.sleep(1.5)
            second = passes()
            moving = [u for u in first if u in second and second[u] > first[u]]
            return moving[0] if len(moving) == 1 else None
        return wait_for(grows, 30, "one replica to lead")

    def stop(self) -> None:
        stop_tree(self.proc, signal.SIGINT, 60)


@pytest.fixture
def cluster(tmp_path):
    started: list[UpCluster] = []

    def start(nodes: int) -> UpCluster:
        c = UpCluster(tmp_path, nodes)
        started.append(c)
        return c

    yield start
    for c in started:
        c.stop()


def assert_trained_through(api: httpx.Client, job_id: str, attempt: int, watch: SnapshotWatch,
                           steps: int) -> None:
    """Succeeded in its first group: 0 restarts, no member lost, rank 0's steps 1..steps once
    each with no resume (0 steps lost), every committed snapshot still there."""
    done = wait_state(api, job_id, ("SUCCEEDED", "FAILED"), timeout_s=300)
    assert done["state"] == "SUCCEEDED", events_of(api, job_id)
    assert done["restarts"] == 0 and done["attempt"] == attempt, events_of(api, job_id)
    reasons = " ".join(e["reason"] for e in events_of(api, job_id))
    assert "lost" not in reasons and "new rendezvous" not in reasons, reasons
    trace = check_steps(api, job_id, watch=watch)
    assert trace.resumes == [] and trace.steps == list(range(1, steps + 1)), trace.resumes
    assert latest_step(api, job_id) == steps
    watch.check(api)


def test_the_leader_is_killed_mid_job_and_one_etcd_member_too(cluster, tmp_path):
    c = cluster(nodes=3)
    late = NodeAgentProc(c, "late", tmp_path / "late")
    try:
        with c.client(c.urls[0]) as api:
            wait_nodes(api, 3)
            # 150 steps of 0.1 s on two nodes; local-2 stays free for the job submitted at the kill.
            job_id = submit(api, train_spec("ha", 150, every=5, delay_s=0.1, mn=2, mx=2))
            wait_latest(api, job_id, 10)
            attempt = job(api, job_id)["attempt"]
        leader = c.leader()
        survivor = next(u for u in c.urls if u != leader)
        c.url = survivor
        with SnapshotWatch(c, job_id) as watch, c.client() as api:
            os.kill(c.replica_pid(leader), signal.SIGKILL)
            killed_at = time.time()
            late.start(server=c.server)  # a node that joins during the outage
            quick = submit(api, train_spec("at-the-kill", 100, every=10, delay_s=0.1))
            wait_state(api, quick, ("RUNNING", "SUCCEEDED"), timeout_s=30)
            started = next(e["time"] for e in events_of(api, quick) if e["state"] != "PENDING")
            print(f"\nleader SIGKILLed: the other replica scheduled a job {started - killed_at:.2f} s "
                  "after the kill")
            # The leader's lease is 2 s: a new leader schedules within 3 s of the kill.
            assert started - killed_at < 3.0, events_of(api, quick)
            # `up` starts the killed replica again after its backoff, and it may win the
            # election as well as the survivor: either way one replica leads, not two.
            assert c.leader() in c.urls
            assert "restarting it in" in c.out_path.read_text()
            # The node that joined in the outage is alive and given work: the job holds two
            # nodes and `quick` one of the others (local-2 or the late one), so a job submitted
            # now runs on the one left, and between them both free nodes are used.
            wait_for(lambda: "late" in [n["name"] for n in api.get("/v1/nodes").json()["items"]],
                     60, "the late node to join")
            on_quick = job(api, quick)
            assert on_quick["state"] == "RUNNING", on_quick
            third = submit(api, train_spec("next", 10, every=5, delay_s=0.05))
            on_third = wait_state(api, third, "SUCCEEDED", timeout_s=240)
            assert sorted(on_quick["nodes"] + on_third["nodes"]) == ["late", "local-2"]
            assert wait_state(api, quick, "SUCCEEDED", timeout_s=240)["restarts"] == 0
            # One etcd member SIGKILLed, its leader (an election follows): nothing noticed. Reads
            # are answered meanwhile; a job submitted at the kill through the CLI's client (a
            # write etcd refuses during the election is a 503, which that client retries, its
            # Idempotency-Key making the retry safe) is accepted and scheduled.
            os.kill(c.etcd_leader_pid(), signal.SIGKILL)
            killed_at = time.time()
            with FtrainClient(c.server, c.user_token) as cli:
                at_etcd_kill = cli.submit(train_spec("at-the-etcd-kill", 10, every=5, delay_s=0.05))["id"]
            while time.time() - killed_at < 4:
                for path in ("/readyz", f"/v1/jobs/{job_id}", f"/v1/jobs/{job_id}/snapshots"):
                    resp = api.get(path)
                    assert resp.status_code == 200, (path, resp.status_code, resp.text)
                time.sleep(0.1)
            assert wait_state(api, at_etcd_kill, "SUCCEEDED", timeout_s=240)["restarts"] == 0
            assert_trained_through(api, job_id, attempt, watch, 150)
        assert c.proc.poll() is None, c.out_path.read_text()  # `up` serves on with what is left
    finally:
        late.stop()


def test_rolling_restart_of_both_control_planes_and_every_etcd_member(tmp_path):
    """The same layout built from its parts (3 etcd members, 2 `ftrain serve`, 2 agents given
    both URLs), since `up` starts a part that exits again by itself: each part
    in turn is stopped (SIGTERM) and started again on its own data while the job trains."""
    members = [EtcdProcess(tmp_path / f"etcd-{i}", name=f"m{i}", log_path=tmp_path / f"etcd-{i}.log")
               for i in range(3)]
    cluster_spec = ",".join(f"{m.name}={m.peer_url}" for m in members)
    for m in members:
        m.initial_cluster = cluster_spec
    start_cluster(members)
    endpoints = cluster_endpoints(members)
    a = ControlPlane(endpoints, tmp_path / "a").start()
    b = ControlPlane(endpoints, tmp_path / "b", user_token=a.user_token, node_token=a.node_token)
    b.secret_dir, b.snapshot_root, b.log_root = a.secret_dir, a.snapshot_root, a.log_root
    b.start()
    both = f"{a.url},{b.url}"
    agents = [NodeAgentProc(a, f"n{i}", tmp_path / f"n{i}").start(server=both) for i in range(2)]
    view = UpView(urls=[a.url, b.url], user_token=a.user_token)
    try:
        with view.client(a.url) as api:
            wait_nodes(api, 2)
            job_id = submit(api, train_spec("rolling", 250, every=5, delay_s=0.1, mn=2, mx=2))
            wait_latest(api, job_id, 10)
            attempt = job(api, job_id)["attempt"]
        with SnapshotWatch(view, job_id) as watch:  # polls whichever replica view.url names
            for cp, other in ((a, b), (b, a)):
                view.url = other.url
                with view.client() as api:
                    before = latest_step(api, job_id) or 0
                    cp.stop()
                    cp.start(timeout_s=60)
                    wait_committed(api, job_id, before + 10)
            for m in members:
                with view.client() as api:
                    before = latest_step(api, job_id) or 0
                    m.stop()
                    m.launch()  # its data directory holds the member: it rejoins the cluster
                    m.wait_serving(30)
                    wait_committed(api, job_id, before + 10)
            with view.client() as api:
                assert_trained_through(api, job_id, attempt, watch, 250)
    finally:
        for agent in agents:
            agent.stop()
        a.stop()
        b.stop()
        for m in members:
            m.stop()


class UpView:
    """What SnapshotWatch needs of a control plane, over the replica `url` names now."""

    def __init__(self, urls: list[str], user_token: str):
        self.urls, self.user_token, self.url = urls, user_token, urls[0]

    def client(self, url: str | None = None) -> httpx.Client:
        return httpx.Client(base_url=url or self.url, timeout=10,
                            headers={"Authorization": f"Bearer {self.user_token}"})


def wait_committed(api: httpx.Client, job_id: str, at_least: int, timeout_s: float = 90) -> int:
    """Like `wait_latest`, and a refusal's body in the failure (not a bare KeyError)."""
    def latest() -> int | None:
        resp = api.get(f"/v1/jobs/{job_id}/snapshots")
        assert resp.status_code == 200, f"{resp.status_code} {resp.text[:300]}"
        step = resp.json()["latest"]
        return step if step is not None and step >= at_least else None
    return wait_for(latest, timeout_s, f"job {job_id} to commit step {at_least} through {api.base_url}")
