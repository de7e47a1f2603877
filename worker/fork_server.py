"""The fork server: one per job on each node, it forks workers with torch imported.

A fresh worker interpreter spends seconds importing torch and, at DDP's first forward,
torch._dynamo (docs/runtime.md has the figures); after a worker failure the whole group
waits for the slowest of them. The node agent therefore
starts, next to torchrun, one process per job that imports those modules once
(`FTRAIN_FORK_SERVER_IMPORTS`, default `PRELOAD`) and then forks a worker for every
`worker/launch.py` that asks: the new worker starts with everything imported, in a few
milliseconds. The job's torchrun starts from it too: the first one is forked as soon as
torchrun's own modules are in (`TORCHRUN_MODULE`), while the server goes on importing what
only workers need; a torchrun of its own would import torch once more.

    python fork_server.py NAME    # listens on the abstract unix socket "\\0NAME" at once;
                                  # requests wait in its backlog while it imports

Protocol, one connection per worker: the launcher sends a 4-byte length with its fds 0,
1 and 2 attached, then that many bytes of JSON {argv, env, cwd, pid}. The server answers
one JSON line, {"pid": N} (forked) or {"decline": why} (the launcher then execs the
command itself); then {"returned": S, "bound_s": T} when the script has returned (S: the
exit status it asked for; T: how long the launcher may wait from now for the worker's
exit), {"finished": true, "bound_s": T} once Python's exit steps have run (below), and,
once the worker has exited, {"status": wait status} ({"status": 0, "note": why} for a
crash after the script had finished; see below).

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

A script that has returned makes its worker exit within a bound, whatever its threads do
(a non-daemon thread that never ends, an atexit handler that blocks, a lock at interpreter
exit: each would keep a finished job RUNNING for ever). When the script returns (or
raises, or exits), the worker tells the server "returned S" and starts a watchdog: if the
worker is still joining its non-daemon threads or running atexit handlers
`FTRAIN_EXIT_TIMEOUT_S` later (a job knob; `DEFAULT_EXIT_TIMEOUT_S`), the watchdog writes a
line to the worker's stderr naming the threads it abandons and where the main thread
waits, and ends the worker with os._exit(S). The watchdog is a Python thread, so it cannot
act while another thread holds the GIL for ever, nor once the interpreter has begun to
finalize; for those the launcher is the backstop: from "returned" it waits at most the
timeout plus a grace for finalization (`FINALIZE_GRACE_S`, or the timeout if shorter), and
at most that grace from "finished", then kills the worker and exits with S, with a line
saying so.

CUDA is never initialised here: a process that forks after CUDA is initialised gives
children that cannot use it. If an import does initialise it, every request is declined.

Standbys (GPU nodes). A restarted GPU worker spends most of its start on costs of its own
process, not of its group: CUDA's context and NCCL's kernels (`worker/standby.py`). So once a
worker of a local rank is forked, the server forks a standby for that local rank as well: a
process that, `STANDBY_DELAY_S` later (not to slow the worker starting beside it), pays
those costs with the worker's environment and says "ready" on its socket. The next request
of that local rank whose environment matches in what the warm-up read
(`standby.fingerprint`) is handed to the standby (its fds and body, sent on that socket)
instead of forking: the standby becomes the worker as a forked one would (`become_worker`),
and a new standby follows. A standby that is not ready yet, or does not match, is passed by
(the request is forked as before). `STANDBY_ENV` ("0": none; "1": even without an NVIDIA
device, warming nothing; default: when /dev/nvidiactl exists) is read from the request.
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
import warnings

# worker.env.FTRAIN_FORK_SERVER_IMPORTS: this file imports only the standard library (see there).
IMPORTS_ENV = "FTRAIN_FORK_SERVER_IMPORTS"
# In this order: torchrun's own modules first, so that a job's first torchrun, which waits in
# the backlog while the server imports, is forked once they are in (`main`).
TORCHRUN_MODULE = "torch.distributed.run"
PRELOAD = "torch,torch.distributed,torch.distributed.run,torch.nn.parallel,torch._dynamo,ftrain.worker.runtime"
# worker.env.FTRAIN_EXIT_TIMEOUT_S (see there): how long a worker whose script returned may
# take to join its non-daemon threads and run its atexit handlers.
EXIT_TIMEOUT_ENV = "FTRAIN_EXIT_TIMEOUT_S"
DEFAULT_EXIT_TIMEOUT_S = 60.0
# What the interpreter's own finalization may take once the exit steps are done (the launcher's
# bound beyond the exit timeout), or the exit timeout if that is shorter.
FINALIZE_GRACE_S = 10.0
# The worker's lines on its pipe to the server: "returned S" when the script ends with exit
# status S, "finished" once Python's exit steps have run after a good end.
RETURNED = b"returned"
FINISHED = b"finished"
# What a crash in the interpreter's teardown dies of; a finished worker's death by one of
# these is not the script's failure.
TEARDOWN_CRASHES = (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE)
PR_SET_PDEATHSIG = 1
_MAX_REQUEST = 4 << 20
# worker.env.FTRAIN_WORKER_STANDBY (see the module docstring and worker/standby.py).
STANDBY_ENV = "FTRAIN_WORKER_STANDBY"
# A new standby waits this long before its warm-up, so the worker forked beside it (a
# restarted one starts in well under a second from a standby) does not share the GPU's start
# with it; short, so one is ready before the next fault even early in a run.
STANDBY_DELAY_S = 1.0
READY = b"ready"


def wants_standby(env: dict[str, str]) -> bool:
    """Whether a worker with this environment gets a standby of its local rank after it."""
    setting = env.get(STANDBY_ENV, "auto")
    if setting == "0" or not env.get("LOCAL_RANK", "").isdigit():
        return False
    return setting == "1" or os.path.exists("/dev/nvidiactl")


def exit_timeout_s(env: dict[str, str]) -> float:
    """The worker's exit timeout from its environment (`EXIT_TIMEOUT_ENV`), else the default."""
    try:
        value = float(env.get(EXIT_TIMEOUT_ENV, ""))
    except ValueError:
        return DEFAULT_EXIT_TIMEOUT_S
    return value if 0 < value < float("inf") else DEFAULT_EXIT_TIMEOUT_S


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
        self.children: dict[int, Child] = {}
        self.standbys: dict[str, Standby] = {}  # by local rank

    def serve(self, block: bool = True) -> Request | None:
        """Serve forever; returns only in a forked worker, with what it must run. Not `block`:
        serve what is pending, then return None (in the server)."""
        server = os.getpid()
        while True:
            events = self.selector.select(None if block else 0)
            if not events and not block:
                return None
            for key, _ in events:
                try:
                    if key.data == "accept":
                        request = self._accept()
                        if request is not None:
                            return request
                    elif isinstance(key.data, Child):
                        self._hear(key.data)
                    elif isinstance(key.data, Standby):
                        request = self._standby_event(key.data, key.fileobj)
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
        if self._hand_to_standby(conn, request):
            return self._fork_standby(request)
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
        # Never block on the pipe: a process the worker forked (a DataLoader's) may hold the
        # write end open after the worker is gone.
        os.set_blocking(finished_r, False)
        for fd in request.fds:
            os.close(fd)
        self._adopt(Child(pid, os.pidfd_open(pid), conn, finished_r, exit_timeout_s(request.env)))
        return self._fork_standby(request)

    def _adopt(self, child: Child) -> None:
        child.send({"pid": child.pid})
        self.children[child.pid] = child
        self.selector.register(child.pidfd, selectors.EVENT_READ, child.pid)
        self.selector.register(child.pipe, selectors.EVENT_READ, child)

    # ------------------------------------------------------------------ standbys
    def _fork_standby(self, request: Request) -> Request | None:
        """After a worker of a local rank: a standby for the next one (module docstring).
        Returns, in the standby once it is handed a request, that request."""
        rank = request.env.get("LOCAL_RANK", "")
        if not wants_standby(request.env) or rank in self.standbys:
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            ours, theirs = socket.socketpair()
            finished_r, finished_w = os.pipe()
        except OSError as exc:
            log(f"no standby for local rank {rank}: {exc}")
            return None
        try:
            pid = os.fork()
        except OSError as exc:
            for end in (ours, theirs):
                end.close()
            os.close(finished_r)
            os.close(finished_w)
            log(f"no standby for local rank {rank}: fork failed: {exc}")
            return None
        if pid == 0:
            self._close_all(None)
            ours.close()
            os.close(finished_r)
            return wait_as_standby(theirs, request, finished_w)
        theirs.close()
        os.close(finished_w)
        os.set_blocking(finished_r, False)
        standby = Standby(pid, os.pidfd_open(pid), ours, finished_r, request.env)
        self.standbys[rank] = standby
        self.selector.register(ours, selectors.EVENT_READ, standby)
        self.selector.register(standby.pidfd, selectors.EVENT_READ, standby)
        return None

    def _standby_event(self, standby: Standby, fileobj) -> None:
        """A standby said it is ready, or it exited (before any request was handed to it)."""
        if standby.handed or standby.gone:  # an event of the same select, now stale
            return None
        if fileobj is standby.sock and not standby.ready:
            try:
                line = standby.sock.recv(256)
            except OSError:
                line = b""
            if line.startswith(READY):
                standby.ready = True
                said = line[len(READY):].strip().decode(errors="replace")
                log(f"standby {standby.pid} for local rank {standby.rank}: {said}")
                return None
        # Its socket closed, or its pidfd says it exited: gone (a kill, a failed warm-up).
        self._drop_standby(standby)
        _, status = os.waitpid(standby.pid, 0)
        log(f"standby {standby.pid} for local rank {standby.rank} ended (wait status {status})")
        return None

    def _drop_standby(self, standby: Standby) -> None:
        standby.gone = True
        if self.standbys.get(standby.rank) is standby:
            del self.standbys[standby.rank]
        for fileobj in (standby.sock, standby.pidfd):
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(fileobj)
        standby.sock.close()
        os.close(standby.pidfd)
        os.close(standby.pipe)

    def _hand_to_standby(self, conn: socket.socket, request: Request) -> bool:
        """Give `request` to the ready standby of its local rank, if its environment fits."""
        standby = self.standbys.get(request.env.get("LOCAL_RANK", ""))
        if standby is None or not standby.ready or not standby.fits(request.env):
            return False
        body = json.dumps({"argv": request.argv, "env": request.env, "cwd": request.cwd,
                           "pid": request.pid}).encode()
        try:
            socket.send_fds(standby.sock, [struct.pack("!I", len(body))], request.fds)
            standby.sock.sendall(body)
        except OSError as exc:  # it died meanwhile: fork as before
            log(f"standby {standby.pid} could not take a request: {exc}")
            return False
        for fd in request.fds:
            os.close(fd)
        del self.standbys[standby.rank]
        for fileobj in (standby.sock, standby.pidfd):
            self.selector.unregister(fileobj)
        standby.sock.close()
        standby.handed = True
        self._adopt(Child(standby.pid, standby.pidfd, conn, standby.pipe, exit_timeout_s(request.env)))
        return True

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

    def _hear(self, child: Child) -> None:
        """The worker wrote on its pipe (or every writer closed it)."""
        if not child.hear():
            self.selector.unregister(child.pipe)

    def _reap(self, pid: int) -> None:
        child = self.children.pop(pid)
        self.selector.unregister(child.pidfd)
        if child.pipe_open:
            self.selector.unregister(child.pipe)
        os.close(child.pidfd)
        _, status = os.waitpid(pid, 0)
        child.hear()  # what it wrote just before it exited
        os.close(child.pipe)
        reply: dict = {"status": status}
        if child.finished and os.WIFSIGNALED(status) and os.WTERMSIG(status) in TEARDOWN_CRASHES:
            reply = {"status": 0, "note": (
                f"the script finished, then the interpreter died of "
                f"{signal.Signals(os.WTERMSIG(status)).name} while shutting down; reported as exit 0")}
            log(f"worker {pid}: {reply['note']}")
        child.send(reply)
        child.conn.close()

    def _close_all(self, request_conn: socket.socket | None) -> None:
        """In a new worker (or standby): drop everything of the server's (its sockets, its
        children's and standbys' pidfds); only the request's fds stay."""
        self.selector.close()
        self.listener.close()
        for child in self.children.values():
            os.close(child.pidfd)
            os.close(child.pipe)
            child.conn.close()
        for standby in self.standbys.values():
            os.close(standby.pidfd)
            os.close(standby.pipe)
            standby.sock.close()
        if request_conn is not None:
            request_conn.close()


class Child:
    """A worker the server forked: its pidfd, its launcher's connection, and its pipe."""

    def __init__(self, pid: int, pidfd: int, conn: socket.socket, pipe: int, exit_timeout_s: float):
        self.pid, self.pidfd, self.conn, self.pipe = pid, pidfd, conn, pipe
        self.finalize_s = min(FINALIZE_GRACE_S, exit_timeout_s)
        self.bound_s = exit_timeout_s + self.finalize_s
        self.pipe_open = True
        self.finished = False
        self._heard = b""

    def send(self, message: dict) -> None:
        try:
            self.conn.sendall(json.dumps(message).encode() + b"\n")
        except OSError:
            pass  # the launcher is gone; the worker notices that itself

    def hear(self) -> bool:
        """Read what the worker wrote on its pipe and pass it on; False once it is closed."""
        while self.pipe_open:
            try:
                data = os.read(self.pipe, 256)
            except BlockingIOError:
                return True
            if not data:
                self.pipe_open = False
                break
            self._heard += data
            *lines, self._heard = self._heard.split(b"\n")
            self._heard = self._heard[-64:]  # the worker writes short lines; never hold more
            for line in lines:
                word, _, arg = line.partition(b" ")
                if word == RETURNED and arg.isdigit():
                    self.send({"returned": int(arg), "bound_s": self.bound_s})
                elif word == FINISHED:
                    self.finished = True
                    self.send({"finished": True, "bound_s": self.finalize_s})
        return self.pipe_open


class Standby:
    """A standby the server forked: its pidfd, its socket, its pipe-to-be, what it warmed with."""

    def __init__(self, pid: int, pidfd: int, sock: socket.socket, pipe: int, env: dict[str, str]):
        self.pid, self.pidfd, self.sock, self.pipe = pid, pidfd, sock, pipe
        self.rank = env.get("LOCAL_RANK", "")
        self._env = env
        self.ready = self.handed = self.gone = False

    def fits(self, env: dict[str, str]) -> bool:
        return fingerprint(env) == fingerprint(self._env)


# Environment names whose values a standby's warm-up depends on (CUDA's visible devices,
# NCCL's settings, read once per process): a request whose values differ is not given to it.
FINGERPRINT_PREFIXES = ("CUDA_", "NCCL_", "PYTORCH_", "TORCH_", "NVIDIA_", "LD_", "OMP_")


def fingerprint(env: dict[str, str]) -> tuple:
    """What a request's environment must share with a standby's to be run by it."""
    return (env.get("LOCAL_RANK"),
            tuple(sorted((k, v) for k, v in env.items() if k.startswith(FINGERPRINT_PREFIXES))))


def wait_as_standby(sock: socket.socket, made_for: Request, finished_fd: int) -> Request:
    """In a standby: warm up with the environment of the worker it was made beside, say so,
    and wait to be handed a request; returns it (the server's loop returns it to `main`)."""
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    # worker.procs.STANDBY_NAME: the agent's stop of a group leaves a standby be; `run` names
    # the worker after its script.
    ctypes.CDLL(None).prctl(PR_SET_NAME, ctypes.c_char_p(b"ftrain-standby"))
    server = os.getppid()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(STANDBY_DELAY_S)
    if os.getppid() != server:
        os._exit(0)
    os.environ.clear()
    os.environ.update(made_for.env)
    try:
        from ftrain.worker import standby

        said = standby.warm(int(made_for.env["LOCAL_RANK"]))
    except Exception as exc:  # noqa: BLE001 - a standby that cannot warm up is not used
        log(f"standby warm-up failed: {type(exc).__name__}: {exc}"[:500])
        os._exit(0)
    try:
        sock.sendall(READY + b" " + said.encode()[:200] + b"\n")
        request = Server._read(sock)
    except Exception:  # noqa: BLE001 - the server ended, or sent nothing whole
        os._exit(0)
    sock.close()
    how = plan(request.argv)
    if isinstance(how, str):
        os._exit(70)
    request.how, request.finished_fd = how, finished_fd
    return request


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
    # Its stacks on the agent's signal, plain scripts' too (preloaded with the runtime).
    stacks = sys.modules.get("ftrain.worker.stacks")
    if stacks is not None:
        stacks.register(os.environ)


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
    ending = Ending(finished_fd, exit_timeout_s(os.environ))
    try:
        if how == "module":
            sys.path.insert(0, os.getcwd())
            with warnings.catch_warnings():
                # runpy's warning that the module was imported before it ran: the server
                # imported it on purpose (a forked torchrun), and every attempt's output began with it
                warnings.filterwarnings("ignore", message=PRELOADED_WARNING, category=RuntimeWarning)
                runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.realpath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            ending.returned(_exit_status(exc.code))
            raise  # Python's own exit: the message, threads, atexit, under the watchdog
    except Exception as exc:
        ending.returned(1)
        # The traceback a `python script.py` would print: from the script's frames on, not
        # the server's and runpy's that ran it.
        tb = script_frames(exc.__traceback__)
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        raise SystemExit(1) from None
    except BaseException:  # KeyboardInterrupt and the like: as Python ends on them
        ending.returned(1)
        raise
    ending.returned(0)
    ending.finish()


# runpy's RuntimeWarning for a module run with -m that was imported before (a forked torchrun)
PRELOADED_WARNING = r".*found in sys\.modules after import of package"


def script_frames(tb):
    """`tb` without its outermost frames of this server and of runpy: what is left starts at
    the script (all of it, if the exception was raised in those frames themselves)."""
    first = tb
    while first is not None and (first.tb_frame.f_globals is globals()
                                 or first.tb_frame.f_globals.get("__name__") == "runpy"):
        first = first.tb_next
    return first if first is not None else tb


def _exit_status(code: object) -> int:
    """The exit status Python gives `sys.exit(code)`."""
    return code & 0xFF if isinstance(code, int) else 1


class Ending:
    """The worker's end of its pipe to the server, and the bound on its exit (module docstring)."""

    def __init__(self, fd: int, timeout_s: float):
        self.fd, self.pid, self.pipe = fd, os.getpid(), _identity(fd)
        self.timeout_s = timeout_s
        self.step = "exiting"  # what the main thread is doing, for the watchdog's line
        self._done = threading.Event()

    def returned(self, status: int) -> None:
        """The script ended with `status`: say so, and bound what the exit may take."""
        if os.getpid() != self.pid:
            return  # a child the script forked and that returned: not the worker
        self._write(RETURNED + b" %d\n" % status)
        threading.Thread(target=self._watch, args=(status,), name="ftrain-exit-watchdog",
                         daemon=True).start()

    def finish(self) -> None:
        """The script ended well: do the first steps of Python's exit in Python's order,
        then tell the server, before the interpreter finalizes (see the module docstring)."""
        if os.getpid() != self.pid:
            return
        self.step = "joining non-daemon threads"
        threading._shutdown()  # joins non-daemon threads; Py_FinalizeEx's call is then a no-op
        self.step = "running atexit handlers"
        atexit._run_exitfuncs()  # runs and clears them, as Py_FinalizeEx would next
        self.step = "flushing its output"
        for stream in (sys.stdout, sys.stderr):
            try:
                if stream is not None:
                    stream.flush()
            except (OSError, ValueError):
                return  # Python exits 120 for output it could not write: not finished
        self._done.set()
        self._write(FINISHED + b"\n")

    def _write(self, line: bytes) -> None:
        # The script may have closed the fd, and its number may now be one of its own files.
        if _identity(self.fd) == self.pipe:
            with contextlib.suppress(OSError):
                os.write(self.fd, line)

    def _watch(self, status: int) -> None:
        if self._done.wait(self.timeout_s):
            return
        frames = sys._current_frames()
        main = threading.main_thread()
        stuck = [t for t in threading.enumerate() if t.is_alive() and not t.daemon and t is not main]
        threads = ", ".join(f"{t.name!r} (at {_where(frames.get(t.ident))})" for t in stuck) or "none"
        line = (f"ftrain: the script returned (exit status {status}), but {self.timeout_s:g} s later "
                f"({EXIT_TIMEOUT_ENV}={self.timeout_s:g}) its worker was still {self.step}, the main "
                f"thread at {_where(frames.get(main.ident))}; abandoning non-daemon threads: "
                f"{threads}; exiting with status {status}\n")
        with contextlib.suppress(OSError):
            os.write(2, line.encode(errors="replace"))
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(status)


def _where(frame) -> str:
    """Where a thread waits: its innermost frame outside `threading` and this file."""
    if frame is None:
        return "an unknown place"
    innermost = frame
    while frame is not None and frame.f_code.co_filename in (threading.__file__, __file__):
        frame = frame.f_back
    frame = frame or innermost
    return f"{frame.f_code.co_name} ({frame.f_code.co_filename}:{frame.f_lineno})"


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
    server = Server(listener, None)
    request, decline = None, None
    modules = [m for m in os.environ.get(IMPORTS_ENV, PRELOAD).split(",") if m]
    for i, module in enumerate(modules):
        decline = preload([module])
        if decline:
            break
        # The job's first torchrun waits in the backlog (worker/torchrun.py): forked once its
        # modules are in, it need not import torch itself, and the server goes on importing for
        # the workers (which come after it, and wait for all of the modules).
        if module == TORCHRUN_MODULE and i < len(modules) - 1 \
                and (request := server.serve(block=False)) is not None:
            break  # in the forked process
    if request is None:
        if decline:
            log(f"declining every request: {decline}")
        server.decline = decline
        request = server.serve()
    how, args = request.how
    become_worker(request)
    run(how, args, request.finished_fd)


if __name__ == "__main__":
    main(sys.argv)
