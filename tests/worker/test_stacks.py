"""A worker's stacks on the agent's signal (worker/stacks.py): faulthandler writes every
thread's stack into the worker's folder, and the agent reads the dumps back."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from worker import stacks
from worker.procs import is_alive

REPO = Path(__file__).resolve().parents[2]


def test_register_needs_the_workers_folder_of_output_files():
    assert stacks.register({}) is False


@pytest.mark.integration
def test_a_worker_stuck_in_sleep_dumps_every_thread_and_lives_on(tmp_path):
    """The dump comes from the signal handler in C, while the main thread sits in a call."""
    script = textwrap.dedent("""
        import os, sys, threading, time
        from worker import stacks
        assert stacks.register({"TORCHELASTIC_ERROR_FILE": sys.argv[1]})
        threading.Thread(target=time.sleep, args=(60,), name="other", daemon=True).start()
        def stuck():
            print("ready", flush=True)
            time.sleep(60)
        stuck()
    """)
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "error.json")],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        files = {3: tmp_path / stacks.STACKS_FILE, 4: tmp_path / "missing"}
        assert stacks.pids(files) == {3: proc.pid}  # the agent signals the pids named there only
        os.kill(proc.pid, stacks.STACKS_SIGNAL)
        # 3 s for all: one that never comes (rank 4) is waited for that long
        dumps = stacks.read_dumps(files, 3.0)
        assert is_alive(proc.pid)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert dumps[4] == ""
    assert [x.split(" 0x")[0] for x in dumps[3].splitlines() if " 0x" in x] == ["Thread", "Current thread"]
    assert not dumps[3].startswith(stacks.HEADER)
    # in stuck(): at its sleep, or just back from the print that said "ready" (the signal may
    # come before the main thread reaches the sleep)
    assert re.search(r"line [78] in stuck", dumps[3]) and "in <module>" in dumps[3]
