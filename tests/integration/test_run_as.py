"""`ftrain node --run-as nobody`: the job's processes run as another user, who cannot read
the agent's token files, its environment or the logs, and whose snapshots are its own.

The job is real (torchrun, the fork server, the runtime's snapshots through the control
plane), and its workers are SIGKILLed once after the first snapshot so that the restart
restores from it, as `nobody`.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import stat
import tempfile
from pathlib import Path

import pytest

from tests.helpers.elastic import job, log_items, submit, wait_nodes, wait_state, worker_pids
from tests.helpers.other_user import interpreter_reachable_prefix, needs_root, other_user
from tests.helpers.processes import ControlPlane, NodeAgentProc, wait_for

pytestmark = [pytest.mark.integration, needs_root()]
PROBE = Path(__file__).resolve().parents[1] / "scripts" / "run_as_probe.py"


@pytest.fixture
def open_base():
    """A directory any local user may enter (pytest's tmp_path is root's alone)."""
    base = Path(tempfile.mkdtemp(prefix="ftrain-run-as-", dir="/tmp"))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def private_token(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(secrets.token_urlsafe(16) + "\n")
    path.chmod(0o600)
    return path


def test_workers_run_as_nobody_read_no_token_and_snapshot_as_themselves(etcd, open_base):
    prefix = interpreter_reachable_prefix()
    if prefix is None:
        pytest.skip("nobody cannot run this interpreter, and no mount namespace to fix that")
    nobody = other_user()
    cp = ControlPlane(etcd.endpoint, open_base / "cp").start()
    node_dir = open_base / "node"
    agent = NodeAgentProc(cp, "ra0", node_dir, args=["--run-as", "nobody"], prefix=prefix)
    try:
        # The token files the agent's user keeps: the node's (and, on this machine, the user's).
        tokens = [private_token(node_dir / "node-token"), private_token(open_base / "cp" / "token")]
        agent.start()
        with cp.client() as api:
            wait_nodes(api, 1)
            secret_dirs = [node_dir / "logs", cp.log_root]
            spec = {"name": "run-as", "nodes": {"min": 1, "max": 1}, "max_restarts": 2,
                    "snapshot": {"every_steps": 5, "keep": 2},
                    "command": ["python", str(PROBE), str(agent.pid), *map(str, tokens),
                                *map(str, secret_dirs), "--", "--steps", "20", "--step-delay", "0.1"]}
            job_id = submit(api, spec)
            wait_for(lambda: job(api, job_id).get("latest_snapshot"), 60, "a committed snapshot")
            pids = worker_pids(agent, PROBE)
            assert pids and all(os.stat(f"/proc/{p}").st_uid == nobody.pw_uid for p in pids), pids
            for pid in pids:  # a crash: the restart restores the snapshot, as nobody
                os.kill(pid, signal.SIGKILL)
            done = wait_state(api, job_id, ("SUCCEEDED", "FAILED"), timeout_s=120)
            lines = [i["line"] for i in log_items(api, job_id, rank=0)]
        assert done["state"] == "SUCCEEDED", (done, lines[-20:])
        probes = [x for x in lines if x.startswith("probe ")]
        assert f"probe uid={nobody.pw_uid}" in probes, probes
        for path in [*tokens, *secret_dirs, f"/proc/{agent.pid}/environ"]:
            assert f"probe {path} PermissionError" in probes, (path, probes)
        assert "probe signal-agent PermissionError" in probes, probes
        starts = [x.split()[1] for x in lines if x.startswith("start step=")]
        assert len(starts) >= 2 and starts[0] == "step=0" and starts[-1] != "step=0", starts

        snapshot = Path(done["latest_snapshot"]["path"])
        folder = snapshot.parent
        assert folder == cp.snapshot_root / job_id
        for p, mode in ((folder, 0o700), (snapshot, 0o600)):
            st = p.stat()
            assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (nobody.pw_uid, mode), (p, st)
        # The agent's copy is the agent's; torchrun's per-worker files (`--redirects`) are U's.
        output = [p for p in (node_dir / "logs" / job_id).iterdir() if p.name != "torchrun"]
        assert output and all(stat.S_IMODE(p.stat().st_mode) == 0o600 and p.stat().st_uid == 0
                              for p in output), output
        st = (node_dir / "logs" / job_id / "torchrun").stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o711), st  # U passes through
        st = (node_dir / "logs" / job_id / "torchrun" / agent.name).stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (nobody.pw_uid, 0o700), st
    finally:
        agent.stop()
        cp.stop()


PLANT = Path(__file__).resolve().parents[1] / "scripts" / "plant_links.py"


def test_links_a_job_plants_in_its_log_folder_never_show_root_files_in_its_logs(etcd, open_base):
    """The agent (root) follows the job's output files in torchrun's log folder, which the
    job's user owns: a link there to a root-only file, or a worker folder that is a link to a
    root-only folder, must never have the agent read that file and serve it as the job's log."""
    prefix = interpreter_reachable_prefix()
    if prefix is None:
        pytest.skip("nobody cannot run this interpreter, and no mount namespace to fix that")
    token = secrets.token_hex(16)
    secret_file = open_base / "root-only.txt"
    secret_file.write_text(f"root-only file {token}\n")
    secret_file.chmod(0o600)
    secret_dir = open_base / "root-only-dir"
    secret_dir.mkdir(mode=0o700)
    (secret_dir / "stdout.log").write_text(f"root-only folder {token}\n")
    cp = ControlPlane(etcd.endpoint, open_base / "cp").start()
    agent = NodeAgentProc(cp, "ra1", open_base / "node", args=["--run-as", "nobody"], prefix=prefix)
    try:
        agent.start()
        with cp.client() as api:
            wait_nodes(api, 1)
            spec = {"name": "plant-links", "nodes": {"min": 1, "max": 1}, "max_restarts": 0,
                    "command": ["python", str(PLANT), str(secret_file), str(secret_dir)]}
            job_id = submit(api, spec)
            done = wait_state(api, job_id, ("SUCCEEDED", "FAILED"), timeout_s=120)
            lines = [i["line"] for i in log_items(api, job_id)]
        assert done["state"] == "SUCCEEDED", (done, lines[-20:])
        assert "planted" in lines, lines[-20:]
        run_dir = next((open_base / "node" / "logs" / job_id / "torchrun" / agent.name).iterdir())
        assert (run_dir / "attempt_0" / "7" / "stdout.log").is_symlink()  # planted, and not read
        assert not [x for x in lines if token in x], [x for x in lines if token in x]
        assert token not in (done.get("reason") or "")
    finally:
        agent.stop()
        cp.stop()
