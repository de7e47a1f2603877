"""The CLI waits for a job: `ftrain run --` and `submit --follow` stream the logs, print the
final state and exit with its code (real control plane, agent, torchrun and `ftrain` processes).
The module's tests share one control plane and one agent: each runs a job of its own on them,
one after another, and none stops or restarts them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.processes import REPO, NodeAgentProc

SCRIPT = REPO / "tests" / "scripts" / "exit_with.py"

pytestmark = pytest.mark.shared_control_plane


@pytest.fixture(scope="module")
def agent(_module_control_plane, tmp_path_factory):
    """The module's one node agent, on the module's control plane."""
    node = NodeAgentProc(_module_control_plane, "n0", tmp_path_factory.mktemp("nodes")).start()
    yield node
    node.stop()


def ftrain(control_plane, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTRAIN_")}
    command, *rest = args  # the options before any `--`
    return subprocess.run([sys.executable, "-m", "service.cli", command, "--server", control_plane.url,
                           "--token", control_plane.user_token, *rest],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)


def test_run_dash_dash_follows_a_succeeding_job_and_exits_0(control_plane, api, agent):
    done = ftrain(control_plane, "run", "--name", "hello", "--max-restarts", "0", "--",
                  "python", str(SCRIPT), "0")
    assert done.returncode == 0, done.stderr
    assert "hello from rank 0" in done.stdout
    job_id = done.stderr.split("submitted ", 1)[1].split()[0]
    assert f"{job_id} SUCCEEDED" in done.stderr
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["state"] == "SUCCEEDED"
    assert job["spec"]["command"] == ["python", str(SCRIPT), "0"]
    assert job["spec"]["working_dir"] == str(REPO)


def test_submit_follow_exits_non_zero_with_the_reason_when_the_job_fails(control_plane, api, agent,
                                                                            tmp_path):
    spec = tmp_path / "fails.json"
    spec.write_text(json.dumps({"name": "fails", "command": ["python", str(SCRIPT), "7"],
                                "max_restarts": 0}))
    done = ftrain(control_plane, "submit", "--follow", str(spec))
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "hello from rank 0" in done.stdout
    final = [ln for ln in done.stderr.splitlines() if " FAILED" in ln]
    assert final and "(exit 1)" in final[-1], done.stderr
    job_id = done.stderr.split("submitted ", 1)[1].split()[0]
    assert api.get(f"/v1/jobs/{job_id}").json()["state"] == "FAILED"
    # `logs -f` of the ended job: its lines, then the same final state and code
    again = ftrain(control_plane, "logs", "-f", job_id)
    assert again.returncode == 1 and "hello from rank 0" in again.stdout
    assert f"{job_id} FAILED" in again.stderr
    tail = ftrain(control_plane, "logs", "--tail", "1", job_id)
    assert tail.returncode == 0 and len(tail.stdout.splitlines()) == 1


def test_a_missing_command_fails_the_job_with_a_one_line_reason_that_names_it(control_plane, api, agent):
    done = ftrain(control_plane, "run", "--name", "typo", "--max-restarts", "0", "--", "trian-no-such-x")
    assert done.returncode == 1, done.stderr
    job_id = done.stderr.split("submitted ", 1)[1].split()[0]
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["state"] == "FAILED"
    assert "command not found: trian-no-such-x" in job["reason"] and "\n" not in job["reason"], job["reason"]
    assert "Traceback" not in done.stderr


def test_a_mistyped_script_fails_the_job_at_once_saying_no_such_file(control_plane, api, agent, tmp_path):
    done = ftrain(control_plane, "run", "--name", "typo-script", "--max-restarts", "3", "--",
                  "python", "trian-no-such.py")
    assert done.returncode == 1, done.stderr
    job_id = done.stderr.split("submitted ", 1)[1].split()[0]
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["state"] == "FAILED" and job["restarts"] == 0, job  # no restart can cure it
    assert "no such file: trian-no-such.py" in job["reason"], job["reason"]
    lines = [i["line"] for i in api.get(f"/v1/jobs/{job_id}/logs").json()["items"]]
    assert sum("no such file" in ln for ln in lines) == 1 and not any("Traceback" in ln for ln in lines), lines
