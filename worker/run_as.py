"""`ftrain node --run-as USER`: the job's processes run as an unprivileged user of their own.

The agent keeps what is its own: its credentials (in its environment and in files only
its user reads), its data directory, its logs. Everything of a job (the fork server,
torchrun, the workers it starts) is started as USER instead, with USER's groups and home,
so the user's code cannot read the agent's token files or `/proc/<agent>/environ`, nor
signal or trace the agent. The agent must be root for that (it switches user for each
process it starts, through `subprocess.Popen(user=, group=, extra_groups=)`).

What is the job's is USER's: the job's snapshot directory is created for USER (mode 0700),
and the directories above it that the agent creates are made traversable (0711: enter, not
list) so that USER reaches it. What USER cannot do: read another user's files; what it
still can: everything USER may do on this machine, including, when several jobs run as
the same USER, reach the other jobs' processes and snapshots (one USER per trust domain).
"""

from __future__ import annotations

import errno
import json
import os
import pwd
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from . import safe_files

PRIVATE_DIR_MODE = 0o700
TRAVERSE_ONLY_MODE = 0o711  # others may enter (to reach their own folder below), not list


class RunAsError(ValueError):
    """The run-as user cannot be used; the message says why and what to do."""


@dataclass(frozen=True)
class RunAs:
    """Who the job's processes run as."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str

    @classmethod
    def lookup(cls, user: str, agent_uid: int | None = None) -> RunAs:
        """The user named (or numbered) `user`, checked to be usable by an agent of `agent_uid`.

        Raises:
            RunAsError: no such user, the user is root, or the agent cannot switch to it.
        """
        try:
            pw = pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
        except (KeyError, OverflowError):
            raise RunAsError(f"--run-as {user}: no such user on this machine; create one "
                             "(`useradd --system --no-create-home ftrain-job`) or name another") from None
        if pw.pw_uid == 0:
            raise RunAsError(f"--run-as {user}: that is root, which separates nothing; name an "
                             "unprivileged user") from None
        uid = os.geteuid() if agent_uid is None else agent_uid
        if uid not in (0, pw.pw_uid):
            raise RunAsError(f"--run-as {user}: the agent must run as root to start the job's "
                             f"processes as another user (it runs as uid {uid})")
        return cls(name=pw.pw_name, uid=pw.pw_uid, gid=pw.pw_gid,
                   groups=tuple(os.getgrouplist(pw.pw_name, pw.pw_gid)), home=pw.pw_dir)

    def check_can_run(self, executable: str) -> None:
        """Raise RunAsError unless this user can start `executable` (the jobs' interpreter).

        An interpreter under a directory the user may not enter (pyenv in root's 0700 home,
        a virtualenv in someone's home) would fail every job; better to say so at the start.
        """
        try:
            done = subprocess.run([executable, "-S", "-c", ""], capture_output=True, timeout=60,
                                  cwd="/", **self.popen_kwargs())
        except (OSError, subprocess.SubprocessError) as exc:
            raise RunAsError(f"--run-as {self.name}: that user cannot run {executable} ({exc}); install "
                             "Python and ftrain where every user may read them") from None
        if done.returncode != 0:
            raise RunAsError(f"--run-as {self.name}: {executable} exited with {done.returncode} "
                             f"as that user: {done.stderr.decode(errors='replace')[-500:]}")

    def popen_kwargs(self) -> dict:
        """`subprocess.Popen` arguments that start a process as this user (and only its groups)."""
        return {"user": self.uid, "group": self.gid, "extra_groups": list(self.groups)}

    def environ(self, env: dict[str, str]) -> dict[str, str]:
        """`env` with this user's identity (HOME, USER, LOGNAME) in place of the agent's."""
        return {**env, "HOME": self.home, "USER": self.name, "LOGNAME": self.name}


# What `command_search` finds (the job's command, as the workers' exec would look for it).
FOUND, MISSING, UNKNOWN, NO_CWD = "found", "missing", "unknown", "no-cwd"


def command_search(cwd: str, paths: list[str]) -> str:
    """Whether this process finds one of `paths` (the places exec would look for the job's
    command): FOUND, MISSING, UNKNOWN (a folder on the way it may not read), or NO_CWD
    (`cwd` is no folder it may enter)."""
    if not os.path.isdir(cwd) or not os.access(cwd, os.X_OK):
        return NO_CWD
    for path in paths:
        try:
            os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError:
            return UNKNOWN
        return FOUND  # there (runnable or not: the launcher says which)
    return MISSING


# `command_search` in a process of the job's user: this module and safe_files import only the
# standard library, so `python -S` runs it (the user runs ftrain's worker/launch.py the same way).
_SEARCH = ("import json, sys; sys.path.insert(0, sys.argv[1]); "
           "from worker.run_as import command_search; print(command_search(*json.loads(sys.argv[2])))")


def command_search_as(run_as: RunAs, cwd: str, paths: list[str]) -> str:
    """`command_search` as the job's user: what the agent (root) sees of folders that user may
    not read is not the user's to learn (a command in a root-only folder would be "there" for
    root, "not found" when absent). UNKNOWN when the search itself could not run."""
    root = str(Path(__file__).resolve().parents[1])
    try:
        done = subprocess.run([sys.executable, "-S", "-c", _SEARCH, root, json.dumps([cwd, paths])],
                              capture_output=True, text=True, timeout=60, cwd="/",
                              env={"PATH": os.defpath}, **run_as.popen_kwargs())
    except (OSError, subprocess.SubprocessError):
        return UNKNOWN
    answer = done.stdout.strip()
    return answer if done.returncode == 0 and answer in (FOUND, MISSING, UNKNOWN, NO_CWD) else UNKNOWN


def job_dir(path: Path, run_as: RunAs | None, agent_dirs: tuple[Path, ...] = ()) -> Path:
    """Create the job's own directory `path` (0700, the job's user's) and what is above it;
    returns it with the links of the part that existed resolved.

    Without `run_as`, the directories the agent creates above `path` and `agent_dirs` (the
    agent's own directories on the way, such as its data directory) are 0700. With it, they
    are traversable only (0711), so that the job's user reaches `path`;
    directories above that the agent did not make are left as they are (an operator's
    shared snapshot root must let the user through). Each is made and changed through an fd
    opened with no link on the way (worker/safe_files.py): a job's folder of an earlier
    attempt that its user replaced by a link would have root change the link's target.

    Raises:
        OSError: a link or a file on the way, or `path` is another user's folder.
    """
    above = TRAVERSE_ONLY_MODE if run_as else PRIVATE_DIR_MODE
    path = safe_files.real_path(path)
    parent_fd = safe_files.open_dir(path.parent, make_mode=above)
    try:
        for d in map(safe_files.real_path, agent_dirs):
            if d in path.parents:
                safe_files.give_dir(d, None, None, above)
        fd = safe_files.open_dir(path.name, dir_fd=parent_fd, make_mode=PRIVATE_DIR_MODE)
    finally:
        os.close(parent_fd)
    try:
        owner = os.fstat(fd).st_uid
        if owner not in (os.geteuid(), run_as.uid if run_as else os.geteuid()):
            raise OSError(errno.EPERM, f"{path} belongs to uid {owner}, neither the agent's nor the "
                          "job's user's; remove it or choose another snapshot root")
        if run_as is not None:
            os.fchown(fd, run_as.uid, run_as.gid)
        os.fchmod(fd, PRIVATE_DIR_MODE)
    finally:
        os.close(fd)
    return path
