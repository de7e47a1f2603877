"""`ftrain up` as the supervisor of the local cluster: a part that dies is started again (one
line says so), only Ctrl-C stops the cluster, and a Ctrl-C is a planned stop: its jobs stop at
a step boundary, saved, and go on from there when `up` comes back. An agent started by hand on
up's data directory is one of the cluster's nodes: up's Ctrl-C stops it too."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from service.up import agent_available
from tests.helpers.elastic import submit, wait_state
from tests.helpers.faults import events_of, runs, train_spec
from tests.helpers.processes import REPO, descendants, free_port, pid_alive, stop_tree, wait_for
from tests.integration.test_up import Up
from worker.procs import cmdline

needs_agent = pytest.mark.skipif(not agent_available(), reason="the node agent is not in this build")


def test_a_part_that_dies_again_soon_waits_longer_up_to_a_cap():
    from service.up import BACKOFF_FIRST_S, BACKOFF_MAX_S, STEADY_S, restart_delay

    assert restart_delay(None, 0.1) == BACKOFF_FIRST_S
    assert restart_delay(BACKOFF_FIRST_S, 1.0) == 2 * BACKOFF_FIRST_S
    assert restart_delay(BACKOFF_MAX_S, 1.0) == BACKOFF_MAX_S
    assert restart_delay(BACKOFF_MAX_S, STEADY_S) == BACKOFF_FIRST_S  # it had run well: afresh


def test_an_exit_is_named_by_its_signal_or_its_code():
    from service.up import exit_text

    assert exit_text(-signal.SIGKILL) == "SIGKILL"
    assert exit_text(3) == "code 3"


def parts(up: Up) -> dict[str, list[int]]:
    """`up`'s children by kind: etcd members, control planes (`serve`), node agents (`node`)."""
    assert up.proc is not None
    found: dict[str, list[int]] = {"etcd": [], "serve": [], "node": []}
    for pid in descendants(up.proc.pid):
        argv = [a.decode(errors="replace") for a in cmdline(pid)]
        if argv and Path(argv[0]).name == "etcd":
            found["etcd"].append(pid)
        elif "service.cli" in argv[:-1] and argv[argv.index("service.cli") + 1] in ("serve", "node"):
            found[argv[argv.index("service.cli") + 1]].append(pid)
    return found


def api_of(up: Up, port: int | None = None) -> httpx.Client:
    token = (up.data_dir / "token").read_text().strip()
    return httpx.Client(base_url=f"http://127.0.0.1:{port or up.port}", timeout=10,
                        headers={"Authorization": f"Bearer {token}"})


def node_names(api: httpx.Client) -> set[str]:
    return {n["name"] for n in api.get("/v1/nodes").json()["items"]}


def kill_and_see_it_restarted(up: Up, kind: str, line: str, pid: int | None = None) -> int:
    """SIGKILL one part of `kind` (or `pid`); wait for up's line and for a new process of that
    kind. Returns the new process's PID."""
    before = parts(up)[kind]
    victim = pid or before[0]
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: f"{line} exited (SIGKILL); restarting it in" in up.output(), 30,
             f"`up` to say it restarts the {line}")
    new = wait_for(lambda: [p for p in parts(up)[kind] if p not in before], 60, f"a new {line}")
    assert up.proc is not None and up.proc.poll() is None, up.output()
    return new[0]


@pytest.mark.integration
@needs_agent
def test_up_restarts_a_killed_agent_control_plane_and_etcd(tmp_path):
    up = Up(tmp_path / "data", free_port(), nodes=1)
    try:
        up.start()
        api = api_of(up)
        wait_for(lambda: node_names(api) == {"local-0"}, 30, "local-0 to register")

        kill_and_see_it_restarted(up, "node", "node local-0")
        wait_for(lambda: "local-0" in node_names(api), 60, "local-0 to register again")
        # The last (here the only) control plane: the cluster goes on with a new one.
        kill_and_see_it_restarted(up, "serve", "control plane")
        wait_for(lambda: api.get("/readyz").status_code == 200, 60, "the control plane to serve again")
        kill_and_see_it_restarted(up, "etcd", "etcd")
        wait_for(lambda: api.get("/readyz").status_code == 200 and "local-0" in node_names(api), 60,
                 "the control plane to serve again, with local-0, on the restarted etcd")
        assert "stopping" not in up.output()

        children = descendants(up.proc.pid)
        assert up.interrupt() == 0
        wait_for(lambda: not any(pid_alive(p) for p in children), 15, "every child of `up` to be gone")
    finally:
        up.kill()


@pytest.mark.integration
@needs_agent
def test_an_agent_started_by_hand_on_ups_data_dir_joins_and_stops_with_ctrl_c(tmp_path):
    up = Up(tmp_path / "data", free_port(), nodes=0)
    hand: subprocess.Popen | None = None
    try:
        up.start()
        api = api_of(up)
        env = {k: v for k, v in os.environ.items() if not k.startswith("FTRAIN_")}
        # What the README says to type: no --server, no token (both from the data directory).
        with open(tmp_path / "extra.log", "wb") as log:
            hand = subprocess.Popen([sys.executable, "-m", "service.cli", "node", "--name", "extra",
                                     "--data-dir", str(up.data_dir)], cwd=REPO, env=env,
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        wait_for(lambda: hand.poll() is None and "extra" in node_names(api), 60,
                 "the hand-started node to register")
        assert up.interrupt() == 0
        assert hand.wait(30) == 0, (tmp_path / "extra.log").read_text()
    finally:
        if hand is not None and hand.poll() is None:
            stop_tree(hand, signal.SIGKILL, 10)
        up.kill()


@pytest.mark.integration
@needs_agent
def test_ctrl_c_drains_a_job_and_the_next_up_resumes_it_where_it_stopped(tmp_path):
    """A runtime job that snapshots only every 40 steps: Ctrl-C stops it at a step boundary
    with that step saved (not lost since the last periodic snapshot), says no node was lost,
    and the next `up` resumes it from exactly there."""
    port = free_port()
    first = Up(tmp_path / "data", port, nodes=2)
    second = Up(tmp_path / "data", port, nodes=2)
    try:
        first.start()
        api = api_of(first)
        job_id = submit(api, train_spec("drain", 400, every=40, mn=1, mx=2, delay_s=0.05))
        wait_for(lambda: (api.get(f"/v1/jobs/{job_id}").json().get("progress") or {}).get("step", 0) >= 15,
                 120, "the job to make 15 steps")
        assert first.interrupt(timeout_s=90) == 0
        api = api_of(second.start())
        reasons = " | ".join(e["reason"] for e in events_of(api, job_id))
        assert "lease lapsed" not in reasons and "lost" not in reasons, reasons

        done = wait_state(api, job_id, ("SUCCEEDED", "FAILED"), 240)
        assert done["state"] == "SUCCEEDED", events_of(api, job_id)
        seen = runs(api, job_id)
        before, after = seen[0], seen[1]
        # 0 steps lost: it resumes from a snapshot of the step it stopped at (rank 0's last line
        # may not have been shipped), not from the start (no periodic snapshot was due yet).
        assert after[0] >= before[1][-1] >= 15, f"the first run ended at step {before[1][-1]}; " \
                                                f"the next started from {after[0]}: {seen}"
        assert second.interrupt() == 0
    finally:
        first.kill()
        second.kill()
