"""`--run-as`: which users are refused, and the job's directory that the job's user owns."""

from __future__ import annotations

import os
import stat

import pytest

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
