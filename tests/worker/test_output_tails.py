"""A failed group's last lines read from the ends of its output files, each worker's and
torchrun's (the agent's reader may be far behind after a flood of output:
`worker.torchrun.tails_of_files`)."""

from __future__ import annotations

from worker.torchrun import headline, tails_of_files


def test_the_last_lines_of_each_rank_come_from_the_ends_of_the_files(tmp_path):
    out0, err0 = tmp_path / "0" / "stdout.log", tmp_path / "0" / "stderr.log"
    out1 = tmp_path / "1" / "stdout.log"
    for path in (out0, out1):
        path.parent.mkdir(exist_ok=True)
    torchrun = tmp_path / "n0-attempt1.stderr"
    out0.write_text("".join(f"line {i} {'x' * 90}\n" for i in range(5000)) + "done sk-secret1\n")  # ~500 KB
    err0.write_text("Traceback (most recent call last):\nValueError: boom\n")
    out1.write_text("last of rank 1\n")
    torchrun.write_text("torchrun: worker failed\n")
    tails = tails_of_files([(out0, 0), (err0, 0), (out1, 1), (torchrun, None)], ("sk-secret1",), nbytes=4096)
    assert list(tails[0])[-3:] == ["done ***", "Traceback (most recent call last):", "ValueError: boom"]
    assert list(tails[0])[0].startswith("line ") and len(tails[0]) == 20  # whole lines only
    assert list(tails[1]) == ["last of rank 1"] and list(tails[None]) == ["torchrun: worker failed"]
    assert headline(tails, 1) == "rank 0: ValueError: boom (torchrun exited with code 1)"


class _Shipper:
    def __init__(self):
        self.answering, self.queued = True, 3

    def pending_of(self, job_id: str, attempt: int) -> int:
        return self.queued

    def add(self, *args, **kwargs) -> None:
        pass


class _Exited:
    returncode = 0
    pid = 2 ** 22 + 1  # no such process: nothing left of its tree to kill

    def poll(self) -> int:
        return 0


def _exited_group(tmp_path, shipper, **kw):
    from worker.torchrun import Torchrun, WorkerGroup

    t = Torchrun("n1", "http://cp", tmp_path, None, shipper)
    t.group = WorkerGroup("j", 1, _Exited(), **kw)
    return t


def test_a_group_that_exited_is_reported_once_its_output_is_shipped(tmp_path, monkeypatch):
    """Whoever reads the job's log once it has ended sees every line: the end waits while
    lines are still queued (after an outage of the control plane too: the report went first
    then), at most DRAIN_S; not for a stop."""
    shipper = _Shipper()
    t = _exited_group(tmp_path, shipper)
    assert t.exited() is None  # 3 lines still on their way
    shipper.answering = False  # the control plane away (killed): the end waits for them too
    assert t.exited() is None
    shipper.queued = 0
    assert t.exited() is not None and t.group is None
    shipper.queued = 3
    assert _exited_group(tmp_path, shipper, stop_requested=True).exited() is not None
    late = _exited_group(tmp_path, shipper)
    assert late.exited() is None
    late.group.exited_at -= 61  # DRAIN_S later: reported all the same
    assert late.exited() is not None
