"""The fork server: one per job on each node, it forks workers with torch imported.

A fresh worker interpreter spends seconds importing torch and, at DDP's first forward,
torch._dynamo (docs/runtime.md has the figures); after a worker failure the whole group
waits for the slowest of them. The node agent therefore
starts, next to torchrun, one process per job that imports those modules once
(`FTRAIN_FORK_SERVER_IMPORTS`, default `PRELOAD`) and then forks a worker for every
`worker/launch.py` that asks: the new worker starts with everything imported, in a few
milliseconds.

    python fork_server.py NAME [FD]    # listens on the abstract unix socket "\\0NAME";
                                       # writes "ready" to FD once it has imported

Protocol, one connection per worker: the launcher sends a 4-byte length with its fds 0,
1 and 2 attached, then that many bytes of JSON {argv, env, cwd, pid}. The server answers
one JSON line, {"pid": N} (forked) or {"decline": why} (the launcher then execs the
command itself), and, once the worker has exited, {"status": wait status} ({"status": 0,
"note": why} for a crash after the script had finished; see below).

What the forked worker gets is what a fresh `python script.py` would: the launcher's
environment, working directory, standard streams, argv, sys.path[0] and its own session;
a fresh seed for `random`; torch's thread count from OMP_NUM_THREADS; and a normal
interpreter exit (atexit handlers, non-daemon threads joined). It dies with the launcher
(it watches the launcher's pidfd) and with this server (PR_SET_PDEATHSIG). Commands this
server cannot run faithfully (not the same interpreter, interpreter options other than
-u, no script) are declined. Only processes of the same user may connect.

A script that has finished is not failed by a crash of the interpreter's own teardown.
Once the script returns (or exits 0), the worker does what Python's exit does first (joins
non-daemon threads, runs atexit handlers), flushes its output, and tells the server it has
finished; only then does the interpreter finalize. torch's backends have threads that can
still touch Python objects then: a gloo thread releasing the tensors of the last
collective after finalization has begun aborts the process ("terminate called without an
active exception"; docs/runtime.md says how often). A worker that finished and then died
of SIGABRT, SIGSEGV, SIGBUS, SIGILL or SIGFPE is reported as exit 0, with a note the
launcher prints, instead of costing the job a restart. Anything else (a non-zero exit, an
atexit handler that crashes, a kill from outside) is reported as it happened.

CUDA is never initialised here: a process that forks after CUDA is initialised gives
children that cannot use it. If an import does initialise it, every request is declined.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import json
import os
import random
import runpy
import selectors
import signal
import socket
import stat
import struct
import sys
import threading
import time

# worker.env.FTRAIN_FORK_SERVER_IMPORTS: this file imports only the standard library (see there).
IMPORTS_ENV = "FTRAIN_FORK_SERVER_IMPORTS"
PRELOAD = "torch,torch.distributed,torch.nn.parallel,torch._dynamo,worker.runtime"
FINISHED = b"finished"
# What a crash in the interpreter's teardown dies of; a finished worker's death by one of
# these is not the script's failure.
TEARDOWN_CRASHES = (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE)
PR_SET_PDEATHSIG = 1
_MAX_REQUEST = 4 << 20


class Request:
    def __init__(self, argv: list[str], env: dict[str, str], cwd: str, pid: int, fds: list[int]):
        self.argv, self.env, self.cwd, self.pid, self.fds = argv, env, cwd, pid, fds
        self.how: tuple[str, list[str]] | None = None  # plan(argv), once it is accepted
        self.finished_fd: int | None = None  # in the worker: where it says it has finished


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} ftrain fork server {os.getpid()}: {msg}", file=sys.stderr, flush=True)


def preload(modules: list[str]) -> str | None:
    """Import `modules`; returns why the server must decline every request, or None."""
    for name in modules:
        started = time.monotonic()
        try:
            importlib.import_module(name)
        except Exception as exc:  # the worker will import it itself and see the error
            log(f"could not import {name}: {type(exc).__name__}: {exc}")
            continue
        log(f"imported {name} in {time.monotonic() - started:.2f} s")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA was initialised while importing; a forked worker could not use it"
    return None


def plan(argv: list[str]) -> tuple[str, list[str]] | str:
    """How to run `argv` here: ("path"|"module", the worker's sys.argv), or why not."""
    if not argv or not _same_interpreter(argv[0]):
        return "not this node's Python interpreter"
    rest = list(argv[1:])
    while rest and rest[0] == "-u":  # unbuffered output: the launcher's env says the same
        rest.pop(0)
    if not rest:
        return "no script"
    if rest[0] == "-m":
        return ("module", rest[1:]) if len(rest) > 1 else "no module after -m"
    if rest[0].startswith("-"):
        return f"interpreter option {rest[0]}"
    return "path", rest


def _same_interpreter(path: str) -> bool:
    try:
        return os.path.samefile(path, sys.executable)
    except OSError:
        return False


def parse_request(data: bytes) -> tuple[list[str], dict[str, str], str, int]:
    """A request's body: a JSON object {argv, env, cwd, pid}; ValueError for anything else.

    The peer is a process of this user, but whatever it sends must cost that request only,
    never the server (and with it every worker of the job on this node).
    """
    try:
        body = json.loads(data)
    except RecursionError:  # "[[[[..." nested past the parser's recursion limit
        raise ValueError("request nested too deeply") from None
    if not isinstance(body, dict):
        raise ValueError(f"request is a JSON {type(body).__name__}, not an object")
    missing = [k for k in ("argv", "env", "cwd", "pid") if k not in body]
    if missing:
        raise ValueError(f"request lacks {', '.join(missing)}")
    argv, env, cwd, pid = body["argv"], body["env"], body["cwd"], body["pid"]
    if not (isinstance(argv, list) and all(isinstance(a, str) for a in argv)
            and isinstance(env, dict) and all(isinstance(v, str) for v in env.values())
            and isinstance(cwd, str) and type(pid) is int and pid > 0):
        raise ValueError("argv, env, cwd or pid of the wrong type")
    # os.path, os.environ and os.chdir raise on a NUL; the worker would die of it, or
    # (argv[0], checked in `plan`) the server would.
    if any("\0" in s for s in (*argv, *env, *env.values(), cwd)) or any("=" in k or not k for k in env):
        raise ValueError("a NUL in argv, env or cwd, or an environment name that is empty or has '='")
    return argv, env, cwd, pid


class Server:
    def __init__(self, listener: socket.socket, decline: str | None):
        self.listener = listener
        self.decline = decline
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ, "accept")
        # pid -> (pidfd, the launcher's connection, the read end of its "finished" pipe)
        self.children: dict[int, tuple[int, socket.socket, int]] = {}

    def serve(self) -> Request:
        """Serve forever; returns only in a forked worker, with what it must run."""
        server = os.getpid()
        while True:
            for key, _ in self.selector.select():
                try:
                    if key.data == "accept":
                        request = self._accept()
                        if request is not None:
                            return request
                    else:
                        self._reap(key.data)
                except Exception as exc:  # noqa: BLE001 - one request, never the server
                    if os.getpid() != server:  # a new worker that could not set itself apart
                        os._exit(70)
                    what = "a request" if key.data == "accept" else f"worker {key.data}"
                    log(f"error while serving {what}: {type(exc).__name__}: {exc}")

    def _accept(self) -> Request | None:
        conn, _ = self.listener.accept()
        try:
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            _pid, uid, _gid = struct.unpack("3i", creds)
            if uid != os.getuid():
                conn.close()
                return None
            conn.settimeout(10)
            request = self._read(conn)
        except Exception as exc:  # noqa: BLE001 - whatever a peer sends, the server goes on
            log(f"bad request: {type(exc).__name__}: {exc}"[:500])
            conn.close()
            return None
        how = plan(request.argv) if self.decline is None else self.decline
        if isinstance(how, str):
            return self._refuse(conn, request, how)
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            finished_r, finished_w = os.pipe()
        except OSError as exc:  # out of fds: the launcher runs the command itself
            return self._refuse(conn, request, f"no pipe for the worker: {exc}")
        try:
            pid = os.fork()
        except OSError as exc:  # out of processes or memory: likewise
            os.close(finished_r)
            os.close(finished_w)
            return self._refuse(conn, request, f"fork failed: {exc}")
        if pid == 0:
            self._close_all(conn)
            os.close(finished_r)
            request.how, request.finished_fd = how, finished_w
            return request
        os.close(finished_w)
        # Read once the worker has exited: never block on a writer it left behind (a
        # DataLoader process it forked keeps the write end open).
        os.set_blocking(finished_r, False)
        for fd in request.fds:
            os.close(fd)
        try:
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        except OSError:
            pass  # the launcher is gone; the worker notices that itself
        pidfd = os.pidfd_open(pid)
        self.children[pid] = (pidfd, conn, finished_r)
        self.selector.register(pidfd, selectors.EVENT_READ, pid)
        return None

    @staticmethod
    def _read(conn: socket.socket) -> Request:
        header, fds, _flags, _addr = socket.recv_fds(conn, 4, 3)
        try:
            if len(fds) != 3 or len(header) != 4:
                raise ValueError("expected a length and three file descriptors")
            size = struct.unpack("!I", header)[0]
            if size > _MAX_REQUEST:
                raise ValueError(f"request of {size} bytes")
            data = b""
            while len(data) < size:
                chunk = conn.recv(size - len(data))
                if not chunk:
                    raise ValueError("short request")
                data += chunk
            argv, env, cwd, pid = parse_request(data)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return Request(argv, env, cwd, pid, fds)

    def _refuse(self, conn: socket.socket, request: Request, why: str) -> None:
        for fd in request.fds:
            os.close(fd)
        try:
            conn.sendall(json.dumps({"decline": why}).encode() + b"\n")
        except OSError:
            pass
        conn.close()
        return None

    def _reap(self, pid: int) -> None:
        pidfd, conn, finished_r = self.children.pop(pid)
        self.selector.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        try:
            finished = os.read(finished_r, len(FINISHED)) == FINISHED
        except BlockingIOError:
            finished = False
        os.close(finished_r)
        reply: dict = {"status": status}
        if finished and os.WIFSIGNALED(status) and os.WTERMSIG(status) in TEARDOWN_CRASHES:
            reply = {"status": 0, "note": (
                f"the script finished, then the interpreter died of "
                f"{signal.Signals(os.WTERMSIG(status)).name} while shutting down; reported as exit 0")}
            log(f"worker {pid}: {reply['note']}")
        try:
            conn.sendall(json.dumps(reply).encode() + b"\n")
        except OSError:
            pass
        conn.close()

    def _close_all(self, request_conn: socket.socket) -> None:
        """In a new worker: drop everything of the server's (its sockets, its children's
        pidfds); only the request's fds stay."""
        self.selector.close()
        self.listener.close()
        for pidfd, conn, finished_r in self.children.values():
            os.close(pidfd)
            os.close(finished_r)
            conn.close()
        request_conn.close()


def become_worker(request: Request) -> None:
    """Turn this forked process into the worker a fresh interpreter would have been."""
    os.setsid()
    server = os.getppid()
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    try:
        launcher = os.pidfd_open(request.pid)
    except ProcessLookupError:
        os._exit(70)
    if os.getppid() != server:
        os._exit(70)
    threading.Thread(target=_die_with, args=(launcher,), name="ftrain-launcher-watch", daemon=True).start()
    for target, fd in enumerate(request.fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request.cwd)
    os.environ.clear()
    os.environ.update(request.env)
    unbuffered = bool(request.env.get("PYTHONUNBUFFERED"))
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(write_through=unbuffered)
    extra = [p for p in request.env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[0:0] = extra  # the script's directory goes in front of these in run()
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    torch = sys.modules.get("torch")
    threads = request.env.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def _die_with(pidfd: int) -> None:
    """Block until the launcher exits, then end this worker the way SIGKILL would."""
    sel = selectors.DefaultSelector()
    sel.register(pidfd, selectors.EVENT_READ)
    while not sel.select():
        pass
    os.kill(os.getpid(), signal.SIGKILL)


PR_SET_NAME = 15


def run(how: str, argv: list[str], finished_fd: int) -> None:
    sys.argv = list(argv)
    # `ps -o comm`, top: the script's (or module's) name rather than the server's
    title = (argv[0] if how == "module" else os.path.basename(argv[0])).encode()[:15]
    ctypes.CDLL(None).prctl(PR_SET_NAME, ctypes.c_char_p(title))
    finished = Finished(finished_fd)
    try:
        if how == "module":
            sys.path.insert(0, os.getcwd())
            runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.realpath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
    finished.tell()


class Finished:
    """The worker's end of its "finished" pipe to the server."""

    def __init__(self, fd: int):
        self.fd, self.pid, self.pipe = fd, os.getpid(), _identity(fd)

    def tell(self) -> None:
        """The script ended well: do the first steps of Python's exit in Python's order,
        then tell the server, before the interpreter finalizes (see the module docstring)."""
        if os.getpid() != self.pid:
            return  # a child the script forked and that returned: not the worker
        threading._shutdown()  # joins non-daemon threads; Py_FinalizeEx's call is then a no-op
        atexit._run_exitfuncs()  # runs and clears them, as Py_FinalizeEx would next
        for stream in (sys.stdout, sys.stderr):
            try:
                if stream is not None:
                    stream.flush()
            except (OSError, ValueError):
                return  # Python exits 120 for output it could not write: not finished
        # The script may have closed the fd, and its number may now be one of its own files.
        if _identity(self.fd) == self.pipe:
            with contextlib.suppress(OSError):
                os.write(self.fd, FINISHED)


def _identity(fd: int) -> tuple[int, int] | None:
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISFIFO(st.st_mode) else None


def main(argv: list[str]) -> None:
    name = argv[1]
    if sys.path and sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]  # run as a file: its directory is not the worker's sys.path[0]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)
    listener.listen(64)  # launchers that come while we import wait in the backlog
    decline = preload([m for m in os.environ.get(IMPORTS_ENV, PRELOAD).split(",") if m])
    if decline:
        log(f"declining every request: {decline}")
    if len(argv) > 2:  # tell the agent we are ready: it then starts torchrun through us too
        os.write(int(argv[2]), b"ready\n" if not decline else b"declining\n")
        os.close(int(argv[2]))
    request = Server(listener, decline).serve()
    how, args = request.how
    become_worker(request)
    run(how, args, request.finished_fd)


if __name__ == "__main__":
    main(sys.argv)
