"""The agent reads each worker's own output files (worker/output.py): a line is shipped only
once it is whole, however the worker's writes and the reads fall; an unterminated last line
once its file is final; a folder torch deletes and makes again (a membership change) is read
to its end and told apart from the new one, and torchrun keeps it instead
(`keep_replaced_outputs`)."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

from tests.helpers.processes import wait_for
from tests.worker.group_output import RUN, Shipper, worker_dir, write_worker
from worker.output import LineReader, WorkerDirs, keep_replaced_outputs
from worker.torchrun import Torchrun, WorkerGroup


def test_a_line_caught_half_written_is_shipped_whole_once_its_end_is_there(tmp_path):
    path = tmp_path / "stdout.log"
    with open(path, "wb", buffering=0) as w, open(path, "rb") as r:
        reader = LineReader(r)
        w.write(b"first whole line\nsecond li")  # the worker is in the middle of a write
        assert reader.next_line(final=False) == b"first whole line"
        assert reader.next_line(final=False) is None  # not "second li": its end is not there
        w.write(b"ne, now whole\nthird")
        assert reader.next_line(final=False) == b"second line, now whole"
        assert reader.next_line(final=False) is None
        assert reader.next_line(final=True) == b"third"  # the writer is done: its last line goes
        assert reader.next_line(final=True) is None


def test_a_line_without_an_end_is_shipped_in_bounded_pieces(tmp_path):
    path = tmp_path / "stderr.log"
    path.write_bytes(b"\r 10%" * 100 + b"\nnext\n")  # a progress bar redrawn for a while
    with open(path, "rb") as r:
        reader = LineReader(r, max_pending_bytes=128)
        pieces = [reader.next_line(final=False) for _ in range(6)]
    assert [len(p) for p in pieces[:4]] == [128, 128, 128, 116] and pieces[4:] == [b"next", None]


class Running:
    """torchrun, still running until `exit()`."""

    returncode = None

    def __init__(self):
        self.exited = threading.Event()

    def poll(self):
        if self.exited.is_set():
            self.returncode = 0
        return self.returncode

    def exit(self):
        self.exited.set()


def test_a_folder_made_again_is_read_to_its_end_and_its_successor_is_a_new_worker(tmp_path):
    logs = tmp_path / "logs"
    dirs = WorkerDirs(logs, RUN)
    old = write_worker(logs, 0, 0, ["round 1 line"], rank=0, round_=1)
    dirs.scan()
    (first,) = [dirs.ready.get_nowait()]
    with open(old, "a") as f:
        f.write("its last line, unterminated")
    shutil.rmtree(logs / f"{RUN}_abc123" / "attempt_0")  # torch: a new round at the same restart
    write_worker(logs, 0, 0, ["round 2 line"], rank=1, round_=2)
    dirs.scan()
    second = dirs.ready.get_nowait()
    assert first.replaced and not second.replaced and dirs.ready.empty()
    assert (first.who().rank, first.who().round, second.who().rank, second.who().round) == (0, 1, 1, 2)
    reader = LineReader(first.files["stdout"])
    assert reader.next_line(final=False) == b"round 1 line"  # from the deleted file
    assert reader.next_line(final=True) == b"its last line, unterminated"
    assert LineReader(second.files["stdout"]).next_line(final=False) == b"round 2 line"
    dirs.close()
    for d in (first, second):
        for f in d.files.values():
            f.close()


def test_a_folder_is_read_once_its_launchers_note_is_there(tmp_path):
    logs = tmp_path / "logs"
    dirs = WorkerDirs(logs, RUN)
    folder = worker_dir(logs, 0, 0)  # torch made it; its launcher has not run yet
    (folder / "stdout.log").touch()
    dirs.scan()
    assert dirs.ready.empty()
    write_worker(logs, 0, 0, [], rank=4, round_=7)
    dirs.scan()
    assert dirs.ready.get_nowait().who().rank == 4
    dirs.close()


def test_a_run_folder_of_an_earlier_torchrun_is_not_followed(tmp_path):
    logs = tmp_path / "logs"
    write_worker(logs, 0, 0, ["old"], rank=0, round_=0)
    dirs = WorkerDirs.before_start(logs, RUN)
    dirs.scan(final=True)
    assert dirs.ready.empty()
    dirs.close()


def test_a_replaced_groups_last_line_goes_once_its_file_is_quiet_while_torchrun_runs(tmp_path):
    logs, proc, shipper = tmp_path / "logs", Running(), Shipper()
    path = write_worker(logs, 0, 0, ["whole"], rank=0, round_=0)
    with open(path, "a") as f:
        f.write("cut short by a SIGKILL")
    g = WorkerGroup("j", 1, proc, outputs={})
    Torchrun("n1", "http://cp", tmp_path, None, shipper).follow(g, WorkerDirs(logs, RUN))
    wait_for(lambda: [x.line for x in shipper.lines] == ["whole"], 10, "the whole line")
    os.makedirs(logs / f"{RUN}_abc123" / "attempt_1")  # torch restarted the group
    wait_for(lambda: [x.line for x in shipper.lines] == ["whole", "cut short by a SIGKILL"], 10,
             "the unterminated line, its file final")
    proc.exit()
    for t in g.threads:
        t.join(10)
    assert not any(t.is_alive() for t in g.threads)


def test_torchrun_keeps_the_output_of_a_group_a_membership_change_replaced(tmp_path):
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, Std

    keep_replaced_outputs()
    spec = DefaultLogsSpecs(log_dir=str(tmp_path), redirects=Std.ALL)  # what torchrun makes of --redirects=3
    envs = {r: {"TORCHELASTIC_RUN_ID": RUN, "TORCHELASTIC_RESTART_COUNT": "0"} for r in (0, 1)}
    first = spec.reify({r: dict(e) for r, e in envs.items()})
    Path(first.stdouts[0]).write_text("the first group's line\n")
    second = spec.reify({r: dict(e) for r, e in envs.items()})  # a new round at the same restart count
    assert second.stdouts[0] == first.stdouts[0] and Path(second.stdouts[0]).parent.is_dir()
    (run,) = tmp_path.iterdir()
    assert (run / "attempt_0.1" / "0" / "stdout.log").read_text() == "the first group's line\n"
    third = spec.reify({r: dict(e) for r, e in envs.items()})
    assert (run / "attempt_0.2").is_dir() and Path(third.stdouts[1]).parent.is_dir()


def test_links_and_fifos_in_the_workers_folders_are_never_read(tmp_path):
    """torchrun's log folder is the job's user's (`--run-as`): a worker folder or output file
    there that is a link (to a root-only file), or a FIFO, is not read by the agent, and does
    not block it."""
    logs = tmp_path / "logs"
    (tmp_path / "secret").write_text("root's secret\n")
    (tmp_path / "secret-dir").mkdir()
    (tmp_path / "secret-dir" / "stdout.log").write_text("root's secret\n")
    write_worker(logs, 0, 0, ["the job's line"], rank=0, round_=1)
    linked = worker_dir(logs, 0, 1)
    (linked / "stdout.log").symlink_to(tmp_path / "secret")
    (linked.parent / "2").symlink_to(tmp_path / "secret-dir")
    os.mkfifo(worker_dir(logs, 0, 3) / "stdout.log")
    dirs = WorkerDirs(logs, RUN)
    dirs.scan(final=True)
    found = {}
    while not dirs.ready.empty():
        d = dirs.ready.get_nowait()
        found[d.local_rank] = sorted(d.files)
        for f in d.files.values():
            f.close()
    dirs.close()
    assert found == {0: ["stderr", "stdout"], 1: [], 3: []}, found
