"""The fork server: a real one (`worker/fork_server.py`) and real launchers
(`worker/launch.py`, as torchrun runs them), real signals, real exit statuses."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers.processes import pid_alive, wait_for
from worker.procs import FORK_SERVER, LAUNCH, descendants, is_standby

pytestmark = pytest.mark.integration

# The script under test reports what it saw as one JSON line on stdout, and whether torch
# was already imported when it started: the sign that it was forked from the server.
PROBE = textwrap.dedent("""
    import json, os, random, sys
    preloaded = "torch" in sys.modules
    import torch
    report = {"preloaded": preloaded, "pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv,
              "cwd": os.getcwd(), "path0": sys.path[0], "name": __name__, "x": os.environ.get("X"),
              "rand": random.random(), "threads": torch.get_num_threads(), "sid": os.getsid(0),
              "stdin": sys.stdin.read()}
    print(json.dumps(report), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    mode = sys.argv[1] if len(sys.argv) > 1 else "exit0"
    if mode.startswith("exit"):
        sys.exit(int(mode[4:]))
    if mode == "raise":
        raise RuntimeError("boom from the script")
    if mode == "abort":
        os.abort()
    if mode == "child-returns":
        child = os.fork()
        if child == 0:
            sys.exit(0)  # a child of the script ends the script well: the worker has not
        os.waitpid(child, 0)
        os.abort()
    if mode == "atexit-abort":
        import atexit
        atexit.register(os.abort)
    if mode == "teardown-abort":
        # Finishes well: a non-daemon thread still running (joined before atexit, as Python
        # does), an atexit handler, then a crash while the interpreter tears the module down.
        import atexit, threading, time
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread done", flush=True))).start()
        atexit.register(lambda: print("atexit ran", flush=True))

        class CrashOnTeardown:
            def __del__(self, abort=os.abort):  # bound now: `os` may be gone by then
                abort()

        crash_on_teardown = CrashOnTeardown()
    if mode.startswith("thread-blocks"):
        # main() returns (or exits 3) while a non-daemon thread waits for ever
        import threading
        threading.Thread(target=threading.Event().wait, name="stuck").start()
        if mode == "thread-blocks-exit3":
            sys.exit(3)
    if mode == "atexit-blocks":
        import atexit, threading

        def flush_forever():
            threading.Event().wait()

        atexit.register(flush_forever)
    if mode == "finalize-blocks":
        # Stuck at the interpreter's teardown holding the GIL (a C call through PyDLL keeps
        # it): no Python thread can run then, so only the launcher can end the worker.
        import ctypes

        class BlockOnTeardown:
            def __del__(self, pause=ctypes.PyDLL(None).pause):
                pause()

        block_on_teardown = BlockOnTeardown()
    if mode == "sleep":
        import signal, time
        signal.signal(signal.SIGTERM, lambda *a: (print("got SIGTERM", flush=True), sys.exit(7)))
        print("sleeping", flush=True)
        time.sleep(120)
""")


@pytest.fixture
def fork_server(tmp_path):
    name = f"ftrain-test-{secrets.token_hex(6)}"
    log = open(tmp_path / "server.log", "wb")  # noqa: SIM115 - closed below
    env = {**os.environ, "OMP_NUM_THREADS": "2", "FTRAIN_FORK_SERVER_IMPORTS": "torch"}
    proc = subprocess.Popen([sys.executable, str(FORK_SERVER), name], stdout=log, stderr=log, env=env)
    wait_for(lambda: b"imported torch" in (tmp_path / "server.log").read_bytes(), 60, "the fork server")
    yield name, proc
    for pid in [*descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    log.close()


def launch(tmp_path: Path, server: str | None, *args: str, python_args: tuple[str, ...] = (),
           stdin: bytes = b"", env: dict | None = None, wait: bool = True):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    run_env = {**os.environ, "X": "from-the-launcher", "OMP_NUM_THREADS": "1", **(env or {})}
    run_env.pop("FTRAIN_FORK_SERVER_SOCKET", None)
    if server:
        run_env["FTRAIN_FORK_SERVER_SOCKET"] = server
    out, err = open(tmp_path / "out", "wb"), open(tmp_path / "err", "wb")  # noqa: SIM115
    cwd = tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-S", str(LAUNCH), str(int(signal.SIGKILL)), sys.executable, *python_args,
         str(script), *args], stdin=subprocess.PIPE, stdout=out, stderr=err, env=run_env, cwd=cwd)
    proc.stdin.write(stdin)
    proc.stdin.close()
    if wait:
        proc.wait(60)
    out.close()
    err.close()
    return proc


def launch_sleeper(tmp_path: Path, server: str) -> tuple[subprocess.Popen, int]:
    """A launcher whose worker waits in a sleep; the launcher and the worker's pid."""
    proc = launch(tmp_path, server, "sleep", wait=False)
    wait_for(lambda: "sleeping" in (tmp_path / "out").read_text(), 30, "the worker to start")
    return proc, report(tmp_path)["pid"]


def report(tmp_path: Path) -> dict:
    first = (tmp_path / "out").read_text().splitlines()[0]
    return json.loads(first)


def test_forked_worker_runs_the_script_as_a_fresh_interpreter_would(tmp_path, fork_server):
    name, server = fork_server
    proc = launch(tmp_path, name, "exit0", "a b", stdin=b"input line")
    assert proc.returncode == 0, (tmp_path / "err").read_text()
    r = report(tmp_path)
    assert r["preloaded"] is True  # forked from the server, torch already there
    assert r["ppid"] == server.pid and r["pid"] != proc.pid
    assert r["argv"] == [str(tmp_path / "probe.py"), "exit0", "a b"]
    assert r["cwd"] == str(tmp_path / "cwd") and r["path0"] == str(tmp_path)
    assert r["name"] == "__main__" and r["x"] == "from-the-launcher" and r["stdin"] == "input line"
    assert r["threads"] == 1  # OMP_NUM_THREADS of the launcher, not the server's 2
    assert r["sid"] == r["pid"]  # a session of its own
    assert (tmp_path / "err").read_text() == "to stderr\n"


def test_a_standby_runs_the_next_matching_worker_of_its_rank_and_every_worker_has_its_own_seed(
        tmp_path, fork_server):
    """A standby (forced on: without a GPU it warms nothing up) is made after a worker of a
    local rank; a request whose NCCL settings differ is forked fresh, a matching one is run
    by the standby, as a fresh interpreter would run it. Each worker, forked or a standby,
    draws its own random numbers."""
    name, server = fork_server
    env = {"LOCAL_RANK": "0", "FTRAIN_WORKER_STANDBY": "1", "NCCL_ALGO": "Ring"}
    dirs = [tmp_path / str(i) for i in range(3)]
    for d in dirs:
        d.mkdir()
    assert launch(dirs[0], name, env=env).returncode == 0
    said = wait_for(lambda: re.search(rb"standby (\d+) for local rank 0: ",
                                      (tmp_path / "server.log").read_bytes()), 30, "a standby")
    standby = int(said.group(1))
    assert launch(dirs[1], name, env={**env, "NCCL_ALGO": "Tree"}).returncode == 0
    assert report(dirs[1])["pid"] != standby and pid_alive(standby)  # not this one's
    assert is_standby(standby)  # an agent's stop of a group leaves it be
    proc = launch(dirs[2], name, "exit3", "a b", env=env, stdin=b"input line")
    assert proc.returncode == 3, (dirs[2] / "err").read_text()
    r = report(dirs[2])
    assert r["pid"] == standby and r["ppid"] == server.pid and r["sid"] == standby
    assert r["argv"] == [str(dirs[2] / "probe.py"), "exit3", "a b"] and r["stdin"] == "input line"
    assert r["cwd"] == str(dirs[2] / "cwd") and r["path0"] == str(dirs[2]) and r["threads"] == 1
    assert r["x"] == "from-the-launcher" and (dirs[2] / "err").read_text() == "to stderr\n"
    assert len({report(d)["rand"] for d in dirs}) == 3


def test_exit_code_and_uncaught_exception_reach_torchrun_unchanged(tmp_path, fork_server):
    name, _ = fork_server
    assert launch(tmp_path, name, "exit3").returncode == 3
    assert report(tmp_path)["preloaded"] is True
    assert launch(tmp_path, name, "raise").returncode == 1
    assert "RuntimeError: boom from the script" in (tmp_path / "err").read_text()


def test_a_module_the_server_imported_runs_without_runpys_warning(tmp_path, fork_server):
    """A module the server imported beforehand (as it does torchrun's, `-m torch.distributed.run`;
    here one that `import torch` brings) runs with nothing said of having been imported first."""
    name, _ = fork_server
    env = {**os.environ, "FTRAIN_FORK_SERVER_SOCKET": name}
    done = subprocess.run([sys.executable, "-S", str(LAUNCH), str(int(signal.SIGKILL)), sys.executable,
                           "-m", "torch.__config__"], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "RuntimeWarning" not in done.stderr and "found in sys.modules" not in done.stderr, done.stderr


def test_a_scripts_traceback_begins_at_the_script_as_under_a_fresh_interpreter(tmp_path, fork_server):
    name, _ = fork_server
    assert launch(tmp_path, name, "raise").returncode == 1
    err = (tmp_path / "err").read_text()
    assert report(tmp_path)["preloaded"] is True
    frames = re.findall(r'File "([^"]+)"', err)
    assert frames and frames[0] == str(tmp_path / "probe.py"), err  # not fork_server.py, not runpy
    assert "fork_server.py" not in err and "runpy" not in err, err
    assert err.rstrip().endswith("RuntimeError: boom from the script"), err


def test_a_crash_in_the_interpreters_teardown_after_the_script_finished_is_exit_0(tmp_path, fork_server):
    name, _ = fork_server
    # Run as a plain interpreter would (no fork server), the script does die at teardown.
    plain = launch(tmp_path, None, "teardown-abort")
    assert plain.returncode == -signal.SIGABRT
    assert report(tmp_path)["preloaded"] is False
    proc = launch(tmp_path, name, "teardown-abort")
    assert report(tmp_path)["preloaded"] is True
    assert proc.returncode == 0
    err = (tmp_path / "err").read_text()
    assert "ftrain: the script finished, then the interpreter died of SIGABRT while shutting down" in err
    # Python's exit order, each once: non-daemon threads joined, then atexit handlers.
    lines = (tmp_path / "out").read_text().splitlines()
    assert [x for x in lines if x in ("thread done", "atexit ran")] == ["thread done", "atexit ran"]
    server_log = (tmp_path / "server.log").read_text()
    assert f"worker {report(tmp_path)['pid']}: the script finished" in server_log


EXIT_TIMEOUT = {"FTRAIN_EXIT_TIMEOUT_S": "1"}


def timed_launch(tmp_path: Path, name: str, mode: str) -> tuple[subprocess.Popen, float]:
    started = time.monotonic()
    proc = launch(tmp_path, name, mode, env=EXIT_TIMEOUT)
    return proc, time.monotonic() - started


@pytest.mark.parametrize(("mode", "status"), [("thread-blocks", 0), ("thread-blocks-exit3", 3)])
def test_a_worker_whose_script_returned_exits_within_the_bound_whatever_its_threads_do(
        tmp_path, fork_server, mode, status):
    name, _ = fork_server
    proc, took = timed_launch(tmp_path, name, mode)
    assert report(tmp_path)["preloaded"] is True
    assert proc.returncode == status and took < 15  # without the bound: never
    err = (tmp_path / "err").read_text()
    assert (f"ftrain: the script returned (exit status {status}), but 1 s later "
            "(FTRAIN_EXIT_TIMEOUT_S=1) its worker was still "
            f"{'joining non-daemon threads' if status == 0 else 'exiting'}") in err
    assert "abandoning non-daemon threads: 'stuck' (at wait (" in err
    assert f"exiting with status {status}" in err
    assert not pid_alive(report(tmp_path)["pid"])


def test_a_worker_stuck_in_an_atexit_handler_exits_within_the_bound(tmp_path, fork_server):
    name, _ = fork_server
    proc, took = timed_launch(tmp_path, name, "atexit-blocks")
    assert proc.returncode == 0 and took < 15
    err = (tmp_path / "err").read_text()
    assert "its worker was still running atexit handlers, the main thread at flush_forever (" in err
    assert "abandoning non-daemon threads: none" in err
    assert not pid_alive(report(tmp_path)["pid"])


def test_a_worker_stuck_in_teardown_holding_the_gil_is_killed_by_its_launcher(tmp_path, fork_server):
    name, _ = fork_server
    proc, took = timed_launch(tmp_path, name, "finalize-blocks")
    assert proc.returncode == 0 and took < 15
    worker = report(tmp_path)["pid"]
    err = (tmp_path / "err").read_text()
    assert (f"ftrain: the script returned (exit status 0), but its worker (pid {worker}) had not "
            "exited 1 s later; killed it; reported as exit 0") in err, err
    wait_for(lambda: not pid_alive(worker), 10, "the killed worker to be gone")


@pytest.mark.parametrize("mode", ["abort", "atexit-abort", "child-returns"])
def test_a_crash_before_the_script_finished_is_reported_as_it_happened(tmp_path, fork_server, mode):
    name, _ = fork_server
    proc = launch(tmp_path, name, mode)
    assert report(tmp_path)["preloaded"] is True
    assert proc.returncode == -signal.SIGABRT
    err = (tmp_path / "err").read_text()
    assert "ftrain: the worker" in err and "died of SIGABRT" in err and "shutting down" not in err


@pytest.mark.parametrize(("sig", "said"), [(signal.SIGKILL, "SIGKILL"),
                                           (signal.SIGRTMIN + 3, f"signal {signal.SIGRTMIN + 3}")])
def test_worker_killed_by_a_signal_makes_the_launcher_die_of_the_same_signal(tmp_path, fork_server,
                                                                            sig, said):
    name, _ = fork_server
    proc, worker = launch_sleeper(tmp_path, name)
    assert worker != proc.pid
    os.kill(worker, sig)
    assert proc.wait(10) == -sig
    # said in the worker's log: torch does not say it for a worker it restarts
    assert f"ftrain: the worker (pid {worker}) died of {said}" in (tmp_path / "err").read_text()


def test_a_signal_torchrun_sent_is_not_reported_as_a_death(tmp_path, fork_server):
    name, _ = fork_server
    proc, _ = launch_sleeper(tmp_path, name)
    proc.send_signal(signal.SIGUSR1)  # forwarded; its default action ends the worker
    assert proc.wait(10) == -signal.SIGUSR1
    assert "ftrain:" not in (tmp_path / "err").read_text()


def test_sigterm_to_the_launcher_reaches_the_worker(tmp_path, fork_server):
    name, _ = fork_server
    proc, _ = launch_sleeper(tmp_path, name)
    proc.send_signal(signal.SIGTERM)  # what torchrun sends when it stops its workers
    assert proc.wait(10) == 7
    assert "got SIGTERM" in (tmp_path / "out").read_text()


def test_sigkill_of_the_launcher_takes_the_worker_with_it(tmp_path, fork_server):
    name, _ = fork_server
    proc, worker = launch_sleeper(tmp_path, name)
    proc.kill()
    proc.wait(10)
    wait_for(lambda: not pid_alive(worker), 10, "the forked worker to die with its launcher")


def test_fork_server_killed_takes_its_workers_and_the_launcher_reports_it(tmp_path, fork_server):
    name, server = fork_server
    proc, worker = launch_sleeper(tmp_path, name)
    server.kill()
    assert proc.wait(10) == 1
    wait_for(lambda: not pid_alive(worker), 10, "the worker to die with the fork server")
    assert "fork server went away" in (tmp_path / "err").read_text()


@pytest.mark.parametrize("python_args", [("-O",), ("-X", "importtime")])
def test_commands_it_cannot_run_faithfully_are_execed_instead(tmp_path, fork_server, python_args):
    name, _ = fork_server
    proc = launch(tmp_path, name, "exit4", python_args=python_args)
    assert proc.returncode == 4
    r = report(tmp_path)
    assert r["preloaded"] is False and r["pid"] == proc.pid  # the launcher exec'd python itself


def test_without_a_fork_server_the_launcher_execs_the_command(tmp_path):
    proc = launch(tmp_path, f"ftrain-test-absent-{secrets.token_hex(4)}", "exit5")
    assert proc.returncode == 5
    r = report(tmp_path)
    assert r["preloaded"] is False and r["pid"] == proc.pid
    proc = launch(tmp_path, None, "exit0")
    assert proc.returncode == 0 and report(tmp_path)["pid"] == proc.pid


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to connect as another user")
def test_another_user_is_not_served(tmp_path, fork_server):
    name, _ = fork_server
    # Connect as "nobody" (the kernel records the peer's uid at connect) and send a
    # well-formed request, as worker/launch.py would: the server must hang up unanswered.
    client = textwrap.dedent(f"""
        import json, os, socket, struct
        os.setgid(65534); os.setuid(65534)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect("\\0{name}")
        body = json.dumps({{"argv": ["{sys.executable}", "-c", "0"], "env": {{}}, "cwd": "/",
                           "pid": os.getpid()}}).encode()
        try:  # the server may hang up before any of this is sent
            socket.send_fds(s, [struct.pack("!I", len(body))], [0, 1, 2])
            s.sendall(body)
            print("answered" if s.recv(100) else "closed")
        except (BrokenPipeError, ConnectionResetError):
            print("closed")
    """)
    out = subprocess.run([sys.executable, "-c", client], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "closed"  # hung up without an answer
    assert launch(tmp_path, name, "exit0").returncode == 0  # and still serves its own user
    assert report(tmp_path)["preloaded"] is True


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to listen as another user")
def test_launcher_sends_nothing_to_a_server_of_another_user(tmp_path):
    """Abstract socket names can be taken by anyone: a launcher must not hand its
    environment (the job's token is in it) to a server that is not its own user's."""
    name = f"ftrain-test-squat-{secrets.token_hex(4)}"
    squatter = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, socket
        os.setgid(65534); os.setuid(65534)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind("\\0{name}"); s.listen(1); print("listening", flush=True)
        s.settimeout(30)
        conn, _ = s.accept()
        conn.settimeout(5)
        got = b""
        try:
            while chunk := conn.recv(65536):
                got += chunk
        except (OSError, TimeoutError):
            pass
        print("received", len(got), flush=True)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert squatter.stdout.readline().strip() == "listening"
        proc = launch(tmp_path, name, "exit0")
        assert proc.returncode == 0
        assert report(tmp_path)["pid"] == proc.pid  # exec'd: not handed to the squatter
        assert squatter.stdout.readline().strip() == "received 0"
    finally:
        squatter.kill()
        squatter.wait()


# Requests a launcher would never send, each with the three fds unless it says otherwise:
# (name, body bytes or a JSON value, fds, the length the header claims or None for the real one).
_PY = sys.executable
_GOOD = {"argv": [_PY, "x.py"], "env": {}, "cwd": "/", "pid": 1}
MALFORMED = [
    ("not json", b"not json", 3, None),
    ("not utf-8", b"\xff\xfe{", 3, None),
    ("json list", [1, 2], 3, None),
    ("json number", 42, 3, None),
    ("json string", "argv", 3, None),
    ("json null", None, 3, None),
    ("empty object", {}, 3, None),
    ("argv a string", {**_GOOD, "argv": _PY}, 3, None),
    ("argv of numbers", {**_GOOD, "argv": [1, 2]}, 3, None),
    ("env a list", {**_GOOD, "env": ["A=1"]}, 3, None),
    ("env value a number", {**_GOOD, "env": {"A": 1}}, 3, None),
    ("env name with =", {**_GOOD, "env": {"A=B": "1"}}, 3, None),
    ("cwd a number", {**_GOOD, "cwd": 5}, 3, None),
    ("pid a string", {**_GOOD, "pid": "1"}, 3, None),
    ("pid a bool", {**_GOOD, "pid": True}, 3, None),
    ("pid negative", {**_GOOD, "pid": -1}, 3, None),
    ("NUL in the interpreter", {**_GOOD, "argv": [_PY + "\0", "x.py"]}, 3, None),
    ("NUL in cwd", {**_GOOD, "cwd": "/\0tmp"}, 3, None),
    ("nested past the recursion limit", b"[" * 200_000, 3, None),
    ("a 3 MiB list", [0] * (1 << 20), 3, None),
    ("length over the limit", b"{}", 3, 5 << 20),
    ("shorter than its length", b"{}", 3, 100),
    ("no fds", _GOOD, 0, None),
    ("one fd", _GOOD, 1, None),
]


def test_malformed_requests_are_dropped_and_the_server_goes_on(tmp_path, fork_server):
    """Fuzz: whatever shape a request has, that connection is hung up on, nothing leaks,
    and the server keeps serving (one that died took every worker of its job with it)."""
    name, server = fork_server
    cases = [(n, b.hex() if isinstance(b, bytes) else json.dumps(b), isinstance(b, bytes), fds, size)
             for n, b, fds, size in MALFORMED]
    client = textwrap.dedent(f"""
        import json, os, socket, struct, sys
        def send(body, fds, size):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect("\\0{name}")
            socket.send_fds(s, [struct.pack("!I", len(body) if size is None else size)], [0, 1, 2][:fds])
            try:
                s.sendall(body)
                s.shutdown(socket.SHUT_WR)
                return s.recv(100)
            except (BrokenPipeError, ConnectionResetError):
                return b""
        answers = {{}}
        for name, body, raw, fds, size in json.loads(sys.stdin.read()):
            answers[name] = send(bytes.fromhex(body) if raw else body.encode(), fds, size).decode()
        for partial in (b"", b"\\0\\0"):  # hang up at once, or after half a header
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect("\\0{name}")
            s.sendall(partial)
            s.close()
        print(json.dumps(answers))
    """)
    out = subprocess.run([sys.executable, "-c", client], input=json.dumps(cases), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    answers = json.loads(out.stdout)
    assert answers == {n: "" for n, *_ in MALFORMED}  # each one hung up on, unanswered
    assert server.poll() is None, (tmp_path / "server.log").read_text()[-2000:]
    fds_after = len(os.listdir(f"/proc/{server.pid}/fd"))
    assert launch(tmp_path, name, "exit0").returncode == 0 and report(tmp_path)["preloaded"] is True
    assert len(os.listdir(f"/proc/{server.pid}/fd")) == fds_after  # nothing leaked per request
    log = (tmp_path / "server.log").read_text()
    assert log.count("bad request") >= len(MALFORMED), log[-3000:]
