"""How torchrun starts each worker under ftrain: `python -S launch.py SIG COMMAND...`.

torchrun runs this file (standard library only, no site-packages, so that it starts in
milliseconds) as the worker's entry point. It

1. asks the kernel for SIG when its parent, torchrun, dies (PR_SET_PDEATHSIG survives
   execve), and exits at once if torchrun is already gone;
2. leaves a note of who the worker is (its global rank, and the rendezvous round that formed
   its group: FTRAIN_ROUND, which torchrun's rendezvous handler sets) in the folder of its
   output files, which torchrun names by local rank only; the node agent, which follows those
   files, reads it to tag each line (`WORKER_NOTE`, worker/output.py);
3. asks the job's fork server (`worker/fork_server.py`, its socket named by
   FTRAIN_FORK_SERVER_SOCKET) for a worker that has torch imported already: it sends the
   command, its environment, its working directory and its standard streams, and then
   stands in for that worker. It
   forwards the signals torchrun sends, and exits the way the worker exited (the same
   code, or killed by the same signal), so torchrun sees no difference, and says on
   stderr which signal killed it unless torchrun sent that signal; only a worker
   that finished its script and then crashed in the interpreter's teardown exits 0, with
   the server's note on stderr. Once the server says the script has returned, it waits for
   the worker's exit at most the bound the server gives (the job's exit timeout plus a
   grace for the interpreter's finalization): then it kills the worker and exits with the
   script's status, saying so on stderr. It never waits without a bound for a worker whose
   script is done;
4. otherwise (no fork server, a command it does not run, any error) execs COMMAND, as
   torchrun would have.

A worker started by the fork server watches this process and kills itself when it is
gone, so SIGKILL here (or torchrun's death) still ends the worker.
"""

import ctypes
import json
import os
import signal
import socket
import struct
import sys
import time

PR_SET_PDEATHSIG = 1
# worker.env.FTRAIN_FORK_SERVER_SOCKET: this file imports only the standard library (see there).
FORK_SERVER_SOCKET_ENV = "FTRAIN_FORK_SERVER_SOCKET"
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2, signal.SIGCONT)


def signal_name(sig):
    """SIGKILL for 9; the node agent names a signal the same way (worker/torchrun.py)."""
    try:
        return signal.Signals(sig).name
    except ValueError:  # a real-time signal the enum does not list
        return f"signal {sig}"


# worker.protocol's COMMAND_NOT_FOUND and COMMAND_NOT_EXECUTABLE (this file imports nothing of
# ftrain: it starts in every worker); tests/worker/test_failure_headline.py checks they agree.
COMMAND_NOT_FOUND = "ftrain: command not found: "
COMMAND_NOT_EXECUTABLE = "ftrain: command not executable: "
# worker.env.FTRAIN_ROUND (see there).
ROUND_ENV = "FTRAIN_ROUND"
# The note a worker leaves next to its stdout.log and stderr.log (`leave_note`).
WORKER_NOTE = "ftrain-worker.json"


def leave_note(env):
    """Write {"rank": R, "round": N or null} to WORKER_NOTE in the folder of the worker's
    output files (that of TORCHELASTIC_ERROR_FILE, which torchrun sets per worker), before the
    worker prints anything, and atomically (the agent never reads half of it). Nothing
    without those variables (torchrun itself, started through this file by the fork server)."""
    error_file, rank = env.get("TORCHELASTIC_ERROR_FILE"), env.get("RANK", "")
    if not error_file or not rank.isdigit():
        return
    round_ = env.get(ROUND_ENV, "")
    note = json.dumps({"rank": int(rank), "round": int(round_) if round_.isdigit() else None})
    folder = os.path.dirname(error_file)
    tmp = os.path.join(folder, f".{WORKER_NOTE}.{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(note)
        os.rename(tmp, os.path.join(folder, WORKER_NOTE))
    except OSError:
        pass  # the agent then takes the local rank for the rank, and no round


def _exec(command):
    """Become COMMAND; a missing or unrunnable one is named in one line (exit 127 or 126, as a
    shell does), not a Python traceback."""
    try:
        os.execvp(command[0], command)
    except FileNotFoundError:
        sys.stderr.write(f"{COMMAND_NOT_FOUND}{command[0]}\n")
        sys.stderr.flush()
        os._exit(127)
    except PermissionError:
        sys.stderr.write(f"{COMMAND_NOT_EXECUTABLE}{command[0]}\n")
        sys.stderr.flush()
        os._exit(126)


def _forked_worker(name, command):
    """Run COMMAND in a worker forked by the fork server; returns only if the fork server cannot."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect("\0" + name)
        # Abstract socket names can be taken by anyone on the node: talk only to a server
        # of our own user (the request carries the job's environment, its token included).
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        if struct.unpack("3i", creds)[1] != os.getuid():
            return
    except OSError:
        return
    request = json.dumps({"argv": command, "env": dict(os.environ), "cwd": os.getcwd(),
                          "pid": os.getpid()}).encode()
    try:
        socket.send_fds(conn, [struct.pack("!I", len(request))], [0, 1, 2])
        conn.sendall(request)
        replies = conn.makefile("rb")
        first = json.loads(replies.readline() or b"{}")
    except (OSError, ValueError):
        return
    child = first.get("pid")
    if not child:
        return  # the fork server declined (a command it cannot run): exec it ourselves

    forwarded = set()

    def forward(sig, _frame):
        forwarded.add(sig)
        try:
            os.kill(child, sig)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    status, note = _wait(conn, replies, child)
    if note:
        sys.stderr.write(f"ftrain: {note}\n")
        sys.stderr.flush()
    if status is None:  # the fork server went away: the worker must not outlive it here
        forward(signal.SIGKILL, None)
        sys.stderr.write("ftrain: the worker's fork server went away\n")
        os._exit(1)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in forwarded:
            # A death torchrun did not ask for leaves no trace in the job's log otherwise:
            # torch logs a restarted worker's exit below its default log level.
            sys.stderr.write(f"ftrain: the worker (pid {child}) died of {signal_name(sig)}\n")
            sys.stderr.flush()
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status))


def _wait(conn, replies, child):
    """(wait status or None if the server went away, a note to print) for the worker `child`.

    Unbounded while the script runs; bounded once the server says it has returned.
    """
    deadline = returned = None
    while True:
        if deadline is not None:
            conn.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            line = replies.readline()
        except TimeoutError:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
            waited = time.monotonic() - returned[1]
            note = (f"the script returned (exit status {returned[0]}), but its worker (pid {child}) "
                    f"had not exited {waited:.0f} s later; killed it; reported as exit {returned[0]}")
            return returned[0] << 8, note
        except (OSError, ValueError):
            return None, None
        try:
            reply = json.loads(line) if line else {}
        except ValueError:
            reply = {}
        if not isinstance(reply, dict) or not line:
            return None, None
        now = time.monotonic()
        if "status" in reply:
            return reply["status"], reply.get("note")
        if "returned" in reply:
            returned = (int(reply["returned"]), now)
        if returned is not None and "bound_s" in reply:  # "returned", then "finished"
            bound = now + float(reply["bound_s"])
            deadline = bound if deadline is None else min(deadline, bound)


def main(argv):
    sig, command = int(argv[1]), argv[2:]
    parent = os.getppid()
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent or parent == 1:
        os._exit(70)  # torchrun died before the guard was in place
    leave_note(os.environ)
    name = os.environ.get(FORK_SERVER_SOCKET_ENV)
    if name:
        _forked_worker(name, command)
    _exec(command)


if __name__ == "__main__":
    main(sys.argv)
