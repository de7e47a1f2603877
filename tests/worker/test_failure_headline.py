"""A failed group's one-line reason (`worker.torchrun.headline`), the agent's check for a
missing command before it starts torchrun (`missing_command`), and the launcher naming a
missing command: tables, no processes but one exec of a name that does not exist."""

import os
import subprocess
import sys

import pytest

from worker.torchrun import headline, missing_command

TRACEBACK = ["Traceback (most recent call last):", '  File "train.py", line 3, in <module>',
             "ValueError: boom"]


@pytest.mark.parametrize("tails,code,line", [
    ({0: ["ftrain: command not found: trian"], None: ["torchrun noise"]}, 1, "command not found: trian"),
    ({0: ["ftrain: command not executable: ./run.sh"]}, 1, "command not executable: ./run.sh"),
    ({0: ["step 1"], 1: TRACEBACK}, 1, "rank 1: ValueError: boom (torchrun exited with code 1)"),
    ({0: ["step 1", "bye"]}, 3, "rank 0: bye (torchrun exited with code 3)"),
    ({0: ["step 1", "bye"], 1: ["RuntimeError: x"]}, 1,
     "rank 1: RuntimeError: x (torchrun exited with code 1)"),
    ({None: ["torchrun says"]}, 1, "torchrun exited with code 1"),
])
def test_headline(tails, code, line):
    assert headline(tails, code) == line


INFO = "2026-01-01 10:00:00,000 ftrain.runtime: rank 1: started and restored in phases (s): group 1.1"


def test_a_torchrun_killed_by_a_signal_is_the_reason_not_a_workers_last_line():
    assert headline({1: [INFO], None: ["ftrain: the worker (pid 7) died of SIGKILL"]}, -9, 4321) \
        == "torchrun (pid 4321) was killed by SIGKILL"


def test_torchrun_saying_why_it_failed_comes_before_a_workers_log_line():
    tails = {1: [INFO], None: ["ftrain: the worker's fork server went away"]}
    assert headline(tails, 1) == "torchrun exited with code 1: ftrain: the worker's fork server went away"


@pytest.mark.integration
def test_the_launcher_names_a_missing_command_in_one_line_and_exits_127():
    # argv[1] is the death signal; the launcher's guard needs a live parent: this test.
    done = subprocess.run([sys.executable, "-m", "worker.launch", "15", "ftrain-no-such-command-x"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 127
    assert done.stderr == "ftrain: command not found: ftrain-no-such-command-x\n"


def test_the_launcher_and_the_protocol_agree_on_the_lines():
    from worker import launch, protocol

    assert launch.COMMAND_NOT_FOUND == protocol.COMMAND_NOT_FOUND
    assert launch.COMMAND_NOT_EXECUTABLE == protocol.COMMAND_NOT_EXECUTABLE


@pytest.mark.parametrize("lines,why", [
    (["[rank0] step=1", "[rank0 stderr] failing on purpose", "[rank0] step=2"],
     "[rank0 stderr] failing on purpose"),
    (["[rank0] a", "[rank0 stderr] Traceback", "[rank0 stderr] KeyError: 'x'", "[rank0] b"],
     "[rank0 stderr] KeyError: 'x'"),
    (["[rank0] ftrain: command not found: trian"], "command not found: trian"),
    (["[rank0] a", "[rank0] b"], "[rank0] b"),
    ([], None),
])
def test_telling_line_of_the_stored_tail(lines, why):
    from worker.protocol import telling_line

    assert telling_line(lines) == why


def test_a_missing_command_is_named_before_torchrun_starts(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "train-x").write_text("#!/bin/sh\n")
    (tmp_path / "run.sh").write_text("#!/bin/sh\n")
    env = {"PATH": f"/nonexistent:{bin_dir}"}
    cwd = str(tmp_path)
    assert missing_command(["train-x", "--lr", "1"], env, cwd) is None  # on the job's PATH
    assert missing_command(["trian-x"], env, cwd) == "command not found: trian-x"
    assert missing_command(["./run.sh"], env, cwd) is None  # a slash: relative to the job's folder
    assert missing_command(["./rnu.sh"], env, cwd) == "command not found: ./rnu.sh"
    assert missing_command([str(bin_dir / "train-x")], {}, "/") is None
    assert missing_command(["run.sh"], {"PATH": ""}, cwd) is None  # an empty entry: the folder
    assert missing_command(["trian-x"], env, str(tmp_path / "gone")) is None  # start says why


def test_a_missing_python_script_is_named_before_torchrun_starts(tmp_path):
    (tmp_path / "train.py").write_text("print('hi')\n")
    env = {"PATH": os.environ["PATH"]}
    cwd = str(tmp_path)
    python = os.path.basename(sys.executable)
    assert missing_command([python, "train.py"], env, cwd) is None
    assert missing_command([python, "-u", "trian.py", "--lr", "1"], env, cwd) == \
        f"no such file: trian.py (in {cwd})"
    assert missing_command([sys.executable, "-X", "dev", "trian.py"], env, cwd) == \
        f"no such file: trian.py (in {cwd})"
    assert missing_command([python, "-m", "trian"], env, cwd) is None  # a module: not a file to find
    assert missing_command(["bash", "trian.sh"], env, cwd) is None  # not Python: the launcher says


@pytest.mark.parametrize("command, script", [
    (["python", "train.py"], "train.py"),
    (["python3.11", "-u", "-W", "ignore", "a/train.py", "-x"], "a/train.py"),
    (["/usr/bin/python3", "-c", "print(1)"], None),
    (["python", "-m", "pkg.train"], None),
    (["torchrun", "train.py"], None),
    (["python"], None),
])
def test_python_script_is_the_file_an_interpreter_runs(command, script):
    from worker.torchrun import python_script

    assert python_script(command) == script
