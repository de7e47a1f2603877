"""`--run-as`: which users are refused, and the job's directory that the job's user owns."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.helpers.other_user import interpreter_reachable_prefix, needs_root
from worker.run_as import RunAs, RunAsError, job_dir


def test_run_as_refuses_root_an_unknown_user_and_an_agent_that_cannot_switch():
    with pytest.raises(RunAsError, match="that is root"):
        RunAs.lookup("root", agent_uid=0)
    with pytest.raises(RunAsError, match="no such user"):
        RunAs.lookup("no-such-user-ftrain", agent_uid=0)
    with pytest.raises(RunAsError, match="must run as root"):
        RunAs.lookup("nobody", agent_uid=1234)
    nobody = RunAs.lookup("nobody", agent_uid=0)
    assert nobody.uid == RunAs.lookup(str(nobody.uid), agent_uid=0).uid
    env = nobody.environ({"HOME": "/root", "USER": "root", "PATH": "/bin"})
    assert env == {"HOME": nobody.home, "USER": "nobody", "LOGNAME": "nobody", "PATH": "/bin"}
    assert nobody.popen_kwargs() == {"user": nobody.uid, "group": nobody.gid,
                                     "extra_groups": list(nobody.groups)}


def mode(p) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_job_dir_without_run_as_is_private_all_the_way(tmp_path):
    data = tmp_path / "data"
    data.mkdir(mode=0o755)
    made = job_dir(data / "snapshots" / "j1", None, agent_dirs=(data,))
    assert [mode(p) for p in (data, data / "snapshots", made)] == [0o700, 0o700, 0o700]


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_job_dir_with_run_as_is_the_users_and_reachable_but_not_listable_above(tmp_path):
    nobody = RunAs.lookup("nobody", agent_uid=0)
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    made = job_dir(data / "snapshots" / "j1", nobody, agent_dirs=(data,))
    assert [mode(p) for p in (data, data / "snapshots", made)] == [0o711, 0o711, 0o700]
    assert (made.stat().st_uid, made.stat().st_gid) == (nobody.uid, nobody.gid)


_CHECKS = r"""
import json, sys
from worker.run_as import RunAs
from worker.torchrun import missing_command
hidden, gone, work = sys.argv[1:4]
nobody = RunAs.lookup("nobody")
print(json.dumps({
    "command there": missing_command([hidden + "/train.py"], {}, work, nobody),
    "command absent": missing_command([hidden + "/absent.py"], {}, work, nobody),
    "on PATH there": missing_command(["train.py"], {"PATH": hidden}, work, nobody),
    "on PATH absent": missing_command(["absent.py"], {"PATH": hidden}, work, nobody),
    "cwd there": missing_command(["/bin/true"], {}, hidden, nobody),
    "cwd absent": missing_command(["/bin/true"], {}, gone, nobody),
    "open command absent": missing_command([work + "/absent.py"], {}, work, nobody),
}))
"""


@pytest.mark.integration
@needs_root()
def test_the_command_check_tells_the_jobs_user_nothing_of_a_root_only_folder():
    """The agent (root) looks for a `--run-as` job's command before it starts torchrun: what
    it says must be the same whether a file in a folder that user may not read is there or
    not, for the command and for the working directory."""
    prefix = interpreter_reachable_prefix()
    if prefix is None:
        pytest.skip("nobody cannot run this interpreter, and no mount namespace to fix that")
    base = Path(tempfile.mkdtemp(prefix="ftrain-command-", dir="/tmp"))
    try:
        base.chmod(0o755)
        hidden, work = base / "hidden", base / "work"
        hidden.mkdir(mode=0o700)
        work.mkdir(mode=0o755)
        (hidden / "train.py").write_text("print('hi')\n")
        done = subprocess.run([*prefix, sys.executable, "-c", _CHECKS, str(hidden), str(base / "gone"), str(work)],
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
        assert done.returncode == 0, done.stderr
        got = json.loads(done.stdout)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert got["command there"] == got["command absent"], got
    assert got["on PATH there"] == got["on PATH absent"], got
    cwd_there, cwd_absent = got["cwd there"], got["cwd absent"]
    assert cwd_there and cwd_absent and "may enter" in cwd_there, got  # said, never entered as root
    assert cwd_there.replace(str(hidden), "D") == cwd_absent.replace(str(base / "gone"), "D"), got
    assert got["open command absent"] == f"command not found: {work}/absent.py", got  # still said where it may
