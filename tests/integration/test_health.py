"""Health checks with real processes: a node whose `--health-check` fails is QUARANTINED
with the check's output as the reason and gets no job while a healthy node (built-in checks
on: they pass on this CPU machine) does; `ftrain undrain` puts it back in service; a
quarantine its own check made ends by itself once the check passes. Real etcd, control
plane, agents, torchrun, and the `ftrain` CLI as a process."""

from __future__ import annotations

import time

from tests.faults.test_drain_holds import ftrain, node
from tests.helpers.elastic import submit, wait_state
from tests.helpers.processes import REPO, NodeAgentProc, wait_for

SCRIPT = REPO / "tests" / "scripts" / "exit_with.py"
SICK = "echo 'GPU 3: 48 uncorrectable ECC errors'; exit 1"


def start(control_plane, tmp_path, name: str, *args: str) -> NodeAgentProc:
    return NodeAgentProc(control_plane, name, tmp_path / "nodes", args=list(args)).start()


def state_of(api, name: str) -> str | None:
    n = node(api, name)
    return None if n is None else n["state"]


def test_a_node_whose_health_check_fails_gets_no_job_until_undrain(control_plane, api, tmp_path):
    sick = start(control_plane, tmp_path, "sick", "--no-builtin-checks", "--health-check", SICK)
    well = start(control_plane, tmp_path, "well")  # the built-in checks, which pass here
    try:
        quarantined = wait_for(lambda: (n := node(api, "sick")) and n["state"] == "QUARANTINED" and n,
                               90, "node sick to register QUARANTINED")
        assert "48 uncorrectable ECC errors" in quarantined["reason"]
        assert "exited 1" in quarantined["reason"]
        wait_for(lambda: state_of(api, "well") == "READY", 90, "node well to register READY")
        listed = ftrain(control_plane, "nodes")
        assert listed.returncode == 0 and "sick is QUARANTINED" in listed.stdout, listed
        assert "48 uncorrectable ECC errors" in listed.stdout

        # A one-node job goes to the healthy node, not to the quarantined one (first by name).
        job_id = submit(api, {"name": "one", "command": ["python", str(SCRIPT), "0"], "max_restarts": 0})
        done = wait_state(api, job_id, "SUCCEEDED", timeout_s=90)
        assert done["nodes"] == ["well"], done
        assert state_of(api, "sick") == "QUARANTINED"

        # A job that needs both nodes waits for the quarantined one, and runs once it is undrained.
        both = submit(api, {"name": "both", "command": ["python", str(SCRIPT), "0"], "max_restarts": 0,
                            "nodes": {"min": 2, "max": 2}})
        held_until = time.monotonic() + 3  # a job that could start starts within a pass
        while time.monotonic() < held_until:
            assert api.get(f"/v1/jobs/{both}").json()["state"] == "PENDING"
            time.sleep(0.2)
        done = ftrain(control_plane, "undrain", "sick")
        assert done.returncode == 0 and done.stdout.strip() == "sick: READY", done
        ended = wait_state(api, both, "SUCCEEDED", timeout_s=90)
        assert sorted(ended["nodes"]) == ["sick", "well"], ended
        # Its check still fails: after the job, its next check quarantines it again.
        wait_for(lambda: state_of(api, "sick") == "QUARANTINED", 60, "sick quarantined by its next check")
    finally:
        for agent in (sick, well):
            agent.ask_to_stop()
        for agent in (sick, well):
            agent.stop()


def test_a_quarantine_by_the_nodes_own_check_ends_when_the_check_passes(control_plane, api, tmp_path):
    flag = tmp_path / "broken"
    flag.write_text("the scratch disk is read-only\n")
    check = f"if [ -e {flag} ]; then cat {flag}; exit 1; fi"
    agent = start(control_plane, tmp_path, "n0", "--no-builtin-checks", "--health-check", check,
                  "--health-interval", "1")
    try:
        quarantined = wait_for(lambda: (n := node(api, "n0")) and n["state"] == "QUARANTINED" and n,
                               60, "node n0 to register QUARANTINED")
        assert "the scratch disk is read-only" in quarantined["reason"]
        flag.unlink()
        wait_for(lambda: state_of(api, "n0") == "READY", 60, "n0 READY once its check passes")
        assert node(api, "n0")["reason"] is None
    finally:
        agent.stop()
