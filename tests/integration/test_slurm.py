"""ftrain on a real SLURM (tests/helpers/slurm.py): nodes from allocations, and a whole run in one.

Marked `slurm` (`pytest -m slurm` runs them); skipped where SLURM is not installed or the test
is not root. The two that cancel an allocation mid-run take minutes: also `slow`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from bench.harness import REPO, wait_for
from tests.helpers.elastic import SCRIPT, job, submit, wait_state, wait_step
from tests.helpers.faults import SnapshotWatch, check_steps, train_spec, wait_latest
from tests.helpers.slurm import SlurmCluster, slurm_unavailable


pytestmark = [pytest.mark.slurm,
              pytest.mark.skipif(slurm_unavailable() is not None, reason=slurm_unavailable() or "")]


def slow(test):
    return pytest.mark.slow(pytest.mark.skipif(not os.environ.get("FTRAIN_TEST_SLOW"),
                                               reason="slow (minutes): set FTRAIN_TEST_SLOW=1 to run it")(test))


RANKS = REPO / "tests" / "scripts" / "slurm_ranks.py"


@pytest.fixture
def slurm(tmp_path):
    cluster = SlurmCluster(tmp_path / "slurm", nodes=3).start()
    yield cluster
    cluster.stop()


def ftrain(cluster: SlurmCluster, *args: str, cwd: Path, env: dict | None = None, **kw) -> subprocess.Popen:
    """`ftrain ARGS` against `cluster` (SLURM_CONF), with this checkout on the path."""
    environ = {**cluster.env, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "service.cli", *args], cwd=cwd, env=environ, **kw)


def slurm_nodes(cluster: SlurmCluster, control_plane, tmp_path: Path, count: int, name: str) -> str:
    """`ftrain slurm nodes --nodes COUNT` joining `control_plane`; the SLURM job id."""
    token_file = tmp_path / "secret" / "node-token"
    if not token_file.exists():
        token_file.parent.mkdir(mode=0o700)
        token_file.write_text(control_plane.node_token)
        token_file.chmod(0o600)
    proc = ftrain(cluster, "slurm", "nodes", "--nodes", str(count), "--server", control_plane.url,
                  "--token-file", str(token_file), "--data-dir", str(tmp_path / "nodes"),
                  f"--job-name={name}", "-o", str(tmp_path / f"{name}-%j.out"),
                  cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    return out.strip()


def registered(api: httpx.Client) -> set[str]:
    return {n["name"] for n in api.get("/v1/nodes").json()["items"] if n["state"] != "LOST"}


def agent_pids(cluster: SlurmCluster, job_id: str) -> list[int]:
    """The `ftrain node` processes of SLURM job `job_id` (by their SLURM_JOB_ID)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[1:4] == [b"-m", b"service.cli", b"node"] and f"SLURM_JOB_ID={job_id}".encode() in environ:
            found.append(int(entry.name))
    return found


def test_allocation_nodes_join_and_train_a_job_with_slurm_ranks(slurm, control_plane, api, tmp_path):
    slurm_id = slurm_nodes(slurm, control_plane, tmp_path, 2, "pair")
    wait_for(lambda: registered(api) >= {"n1", "n2"}, 60, "the allocation's agents n1 and n2 to register")
    # The token is on no command line and in no agent's environment (nor its SLURM script).
    pids = agent_pids(slurm, slurm_id)
    assert len(pids) == 2
    for pid in pids:
        assert control_plane.node_token.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        assert control_plane.node_token.encode() not in Path(f"/proc/{pid}/environ").read_bytes()
    job_id = submit(api, {"name": "ranks", "command": ["python", str(RANKS)], "nodes": {"min": 2, "max": 2},
                          "nproc_per_node": 2})
    assert wait_state(api, job_id, ("SUCCEEDED", "FAILED"), 120)["state"] == "SUCCEEDED"
    lines = [i["line"] for i in api.get(f"/v1/jobs/{job_id}/logs").json()["items"] if "SLURM" in i["line"]]
    seen = {tuple(line.split()[1:]) for line in lines}
    # rank, SLURM_PROCID, local rank, SLURM_LOCALID, world, SLURM_NTASKS: one line per worker
    assert len(seen) == 4 and all(r[0] == r[1] and r[2] == r[3] and r[4] == r[5] == "4" for r in seen), lines

    # SLURM ends the allocation: its agents drain, leave, and exit 0 within KillWait.
    ended = time.monotonic()
    slurm.run("scancel", slurm_id)
    wait_for(lambda: not (registered(api) & {"n1", "n2"}), 60, "n1 and n2 to leave")
    wait_for(lambda: not agent_pids(slurm, slurm_id), 60, "the agents to exit")
    assert time.monotonic() - ended < 25
    out = next(tmp_path.glob("pair-*.out")).read_text()
    assert "Killed" not in out and "exit code" not in out.lower(), out


@slow
def test_scancel_of_an_allocation_loses_no_step_of_a_runtime_job(slurm, control_plane, api, tmp_path):
    keep = slurm_nodes(slurm, control_plane, tmp_path, 1, "keep")
    wait_for(lambda: registered(api) >= {"n1"}, 60, "the first allocation's agent")
    lose = slurm_nodes(slurm, control_plane, tmp_path, 1, "lose")
    wait_for(lambda: len(registered(api)) >= 2, 60, "the second allocation's agent")
    job_id = submit(api, train_spec("slurm-loss", 240, every=10, mn=1, mx=2, delay_s=0.1))
    with SnapshotWatch(control_plane, job_id) as watch:
        wait_for(lambda: job(api, job_id)["world_size"] == 2, 90, "world size 2")
        wait_latest(api, job_id, 20)
        cancelled_at = time.time()
        slurm.run("scancel", lose)
        assert wait_state(api, job_id, ("SUCCEEDED", "FAILED"), 240)["state"] == "SUCCEEDED"
        trace = check_steps(api, job_id, watch=watch)
    assert trace.steps[-1] == 240
    report_recovery("runtime job, scancel of one allocation", trace, cancelled_at)
    # Resumed from the last step it logged or a later one (a step done but not yet logged).
    assert all(resumed >= last for _t, resumed, last in trace.resumes), trace.resumes
    assert keep in slurm.jobs()


def report_recovery(what: str, trace, cancelled_at: float) -> None:
    """Print the steps lost and the time to training again after the cancel at `cancelled_at`."""
    after = [(t, resumed, last) for t, resumed, last in trace.resumes if t >= cancelled_at]
    assert after, f"no restart after the cancel: {trace.resumes}"
    t, resumed, last = after[0]
    print(f"\nSLURM {what}: steps lost {max(0, last - resumed)} (last step logged {last}, resumed "
          f"from {resumed}), training again {t - cancelled_at:.1f} s "
          "after scancel", flush=True)


@slow
def test_slurm_run_of_a_plain_script_survives_a_node_scancel(slurm, tmp_path):
    data = tmp_path / "run"
    run = ftrain(slurm, "slurm", "run", "--nodes", "2:3", "--data-dir", str(data), "--sbatch=-N3",
                 f"--sbatch=--output={tmp_path / 'run.out'}", "--",
                 "python", str(SCRIPT), "--steps", "300", "--step-time", "0.1", "--snapshot-every", "5",
                 cwd=tmp_path)
    wait_for(lambda: (data / "token").exists() and (data / "server").exists(), 120, "the control plane")
    port = (data / "server").read_text().strip().rsplit(":", 1)[1]
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10,
                      headers={"Authorization": f"Bearer {(data / 'token').read_text().strip()}"}) as api:
        job_id = wait_for(lambda: (items := api.get("/v1/jobs").json()["items"]) and items[0]["id"], 60, "the job")
        wait_step(api, job_id, 20, world=3, timeout_s=120)
        slurm_id = slurm.jobs()[0]
        cancelled_at = time.time()
        # A step's scancel is a SIGKILL (SLURM gives steps no KillWait): n3 is lost, not drained.
        slurm.run("scancel", slurm.steps(slurm_id)["n3"])
        # Read while the control plane runs: it ends with the allocation, once the job ends.
        wait_step(api, job_id, 300, timeout_s=240)
        trace = check_steps(api, job_id, every=5)
    assert run.wait(120) == 0, (tmp_path / "run.out").read_text()[-3000:]  # the job's code: SUCCEEDED
    assert trace.steps[-1] == 300
    report_recovery("plain script (ftrain slurm run), scancel of one node's step", trace, cancelled_at)


@slow
def test_a_requeued_allocation_rejoins_under_the_same_names(slurm, control_plane, api, tmp_path):
    slurm_id = slurm_nodes(slurm, control_plane, tmp_path, 2, "pair")
    wait_for(lambda: registered(api) >= {"n1", "n2"}, 60, "the allocation's agents n1 and n2 to register")
    slurm.run("scontrol", "requeue", slurm_id)
    wait_for(lambda: not (registered(api) & {"n1", "n2"}), 60, "n1 and n2 to leave")
    # SLURM holds a requeued job back a while (about 2 to 3 minutes here) before it runs again.
    wait_for(lambda: registered(api) >= {"n1", "n2"}, 240, "n1 and n2 to register again")
