"""What a second local user (`nobody`) can reach: files, directories and etcd, tried for real.

The probe runs as a child process started with that user's uid and gid (the test runs as
root), and reports, for each path, whether it could read it (a file) or list it (a
directory), and for each URL what etcd's HTTP gateway answered. The intruder is such a
child that keeps trying etcd's ports from before etcd listens.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

OTHER_USER = "nobody"

_PROBE = r"""
import json, os, sys, urllib.error, urllib.request
paths, posts = json.loads(sys.argv[1])
out = {"uid": os.getuid(), "paths": {}, "posts": {}}
for p in paths:
    try:
        if os.path.isdir(p):
            os.listdir(p)
        else:
            with open(p, "rb") as f:
                f.read(1)
        out["paths"][p] = "read"
    except OSError as exc:
        out["paths"][p] = type(exc).__name__
for url, body in posts:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body.encode(), method="POST"),
                                    timeout=5) as resp:
            out["posts"][url] = [resp.status, resp.read().decode(errors="replace")[:300]]
    except urllib.error.HTTPError as exc:
        out["posts"][url] = [exc.code, exc.read().decode(errors="replace")[:300]]
    except OSError as exc:
        out["posts"][url] = [0, repr(exc)]
print(json.dumps(out))
"""


_INTRUDER = r"""
import json, socket, sys, time, urllib.error, urllib.request
client, peer, want, deadline_s = json.loads(sys.argv[1])
attempts = [("auth/user/add", {"name": "intruder", "password": "intruder-pw"}),
            ("auth/user/grant", {"user": "intruder", "role": "root"}),
            ("auth/role/add", {"name": "intruder"}),
            ("kv/put", {"key": "L2Z0cmFpbi9wbGFudGVk", "value": "eA=="})]
out = {"accepted": [], "answers": 0, "peer_connects": 0, "first_answer": None}
print("polling", flush=True)
end = time.monotonic() + deadline_s
while time.monotonic() < end and out["answers"] < want:
    for path, body in attempts:
        request = urllib.request.Request(f"http://127.0.0.1:{client}/v3/{path}",
                                         data=json.dumps(body).encode(), method="POST")
        try:
            with urllib.request.urlopen(request, timeout=5) as resp:
                out["accepted"].append([path, resp.read().decode(errors="replace")[:200]])
        except urllib.error.HTTPError as exc:
            out["answers"] += 1
            out["first_answer"] = out["first_answer"] or exc.read().decode(errors="replace")[:200]
        except OSError:
            time.sleep(0.001)  # not listening (yet)
    try:
        socket.create_connection(("127.0.0.1", peer), timeout=0.2).close()
        out["peer_connects"] += 1
    except OSError:
        pass
print(json.dumps(out), flush=True)
"""


def start_etcd_intruder(client_port: int, peer_port: int, answers: int, deadline_s: float
                        ) -> subprocess.Popen:
    """`nobody`, polling etcd's client port from before it listens: at every attempt it tries
    to add a user, grant it root, add a role and write a key, without credentials; and it
    tries to connect to the peer port. It stops after `answers` refusals (or `deadline_s`)
    and prints {"accepted": [[path, body]...], "answers", "peer_connects", "first_answer"}.
    Its first line, "polling", says that it has begun."""
    pw = other_user()
    proc = subprocess.Popen(
        [python_for_other_user(), "-S", "-c", _INTRUDER,
         json.dumps([client_port, peer_port, answers, deadline_s])],
        user=pw.pw_uid, group=pw.pw_gid, extra_groups=[], cwd="/", env={"PATH": "/usr/bin:/bin"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    if proc.stdout.readline().strip() != "polling":
        proc.wait(10)
        raise AssertionError(f"the intruder did not start: {proc.stderr.read()}")
    return proc


def needs_root():
    """Skip unless the tests run as root (they switch to another user)."""
    return pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second local user")


def other_user() -> pwd.struct_passwd:
    return pwd.getpwnam(OTHER_USER)


def probe_as_other_user(paths: list[Path], posts: list[tuple[str, str]] = ()) -> dict:
    """Try every path and POST as `nobody`; {"uid", "paths": {path: "read"|error}, "posts": ...}."""
    pw = other_user()
    done = subprocess.run(
        [python_for_other_user(), "-S", "-c", _PROBE, json.dumps([[str(p) for p in paths], list(posts)])],
        user=pw.pw_uid, group=pw.pw_gid, extra_groups=[], cwd="/", env={"PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["uid"] == pw.pw_uid
    return result


def everything_under(root: Path) -> list[Path]:
    """`root` and every file and directory below it (seen as root), links not followed."""
    out = [root]
    for dirpath, dirnames, filenames in os.walk(root):
        out += [Path(dirpath, n) for n in dirnames + filenames]
    return out


def _others_may_enter(path: Path) -> bool:
    return bool(path.stat().st_mode & 0o001)


def blocked_ancestor(path: Path) -> Path | None:
    """The first directory above `path` that other users may not enter, if any."""
    for parent in reversed(path.parents):
        if not _others_may_enter(parent):
            return parent
    return None


def interpreter_reachable_prefix() -> list[str] | None:
    """A command prefix under which another user can run this interpreter ([] if they can).

    On a machine whose Python lives in root's home (0700), e.g. pyenv's, another user
    cannot run it at all. The prefix runs the command in a private mount namespace where
    that home is an empty tmpfs that others may enter (0711) with only the interpreter's
    folder bound back into it: nothing changes outside the namespace. None: no way found.
    """
    real = Path(os.path.realpath(sys.executable))
    blocked = blocked_ancestor(real)
    if blocked is None:
        return []
    keep = blocked / real.relative_to(blocked).parts[0]
    if blocked_ancestor(keep / "x") not in (blocked, None) or shutil.which("unshare") is None:
        return None
    script = (f"set -e; stash=$(mktemp -d); mount --bind {keep} $stash; "
              f"mount -t tmpfs -o mode=0711 tmpfs {blocked}; mkdir -p {keep}; "
              f"mount --bind $stash {keep}; umount $stash; rmdir $stash; exec \"$@\"")
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script,
                            "sh", "true"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        return None
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh"]


def python_for_other_user() -> str:
    """An interpreter that another user can run (for a standard-library-only probe)."""
    if blocked_ancestor(Path(os.path.realpath(sys.executable))) is None:
        return sys.executable
    return shutil.which("python3", path="/usr/bin:/bin") or sys.executable
