"""torchrun's own shutdown kept out of the job's log: a replaced (or cancelled) attempt's
torchrun traceback becomes one line, a real failure's stays, the workers' lines always go."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.protocol import LogLineIn
from worker.torchrun import Torchrun, WorkerGroup, shutdown_summary, starts_shutdown

GONE = ["Traceback (most recent call last):", '  File "run.py", line 1', "    main()",
        "torch.distributed.elastic.rendezvous.api.RendezvousGoneError: rendezvous j-a1 is gone"]
OWN = ["Traceback (most recent call last):", '  File "run.py", line 1', "ValueError: bad --nnodes"]


@pytest.mark.parametrize("held,stopped,hidden", [
    (GONE, False, True),  # the control plane closed the rendezvous: a new attempt, or the job ended
    (OWN, True, True),  # the agent stopped it (replaced, cancelled): whatever it printed on the way out
    (OWN, False, False),  # torchrun failed by itself: the job's to read
    ([], True, False),  # nothing held
])
def test_which_shutdowns_are_hidden(held, stopped, hidden):
    got = shutdown_summary(held, stopped, 3, "n1")
    assert (got is not None) is hidden
    if hidden:
        assert got == f"ftrain: attempt 3's torchrun on n1 shut down ({len(held)} lines of its own hidden)"


def test_a_shutdown_starts_with_torchruns_own_traceback():
    assert starts_shutdown(GONE[0]) and not starts_shutdown("W1127 Received 15 death signal")
    assert starts_shutdown("W1127 Failed to send a keep-alive heartbeat to the rendezvous 'j-a1' due "
                           "to an error of type RendezvousGoneError.")


class Shipper:
    def __init__(self):
        self.lines: list[LogLineIn] = []

    def add(self, job_id: str, attempt: int, line: LogLineIn, *, wait_for_room: bool = False) -> None:
        self.lines.append(line)


class Exited:
    returncode = 1

    def poll(self) -> int:
        return 1


def pumped(tmp_path: Path, text: str, stop_requested: bool) -> list[tuple[int | None, str]]:
    """What the agent ships of torchrun output `text` for a group that has exited."""
    out = tmp_path / "out"
    out.write_text(text)
    shipper = Shipper()
    t = Torchrun("n1", "http://cp", tmp_path, None, shipper)
    g = WorkerGroup("j", 2, Exited(), stop_requested=stop_requested)
    t._pump(g, "stderr", out)
    t._release_held(g)
    return [(x.rank, x.line) for x in shipper.lines]


def test_a_replaced_attempts_torchrun_traceback_is_one_line_and_the_workers_lines_all_go(tmp_path):
    text = "\n".join(["W torchrun starting", "[rank0]:step=1", *GONE, "[rank0]:bye", ""])
    assert pumped(tmp_path, text, stop_requested=False) == [
        (None, "W torchrun starting"), (0, "step=1"), (0, "bye"),
        (None, "ftrain: attempt 2's torchrun on n1 shut down (4 lines of its own hidden)")]


def test_a_real_failure_keeps_torchruns_traceback(tmp_path):
    text = "\n".join(["[rank0]:step=1", *OWN, ""])
    assert pumped(tmp_path, text, stop_requested=False) == [(0, "step=1"), *[(None, x) for x in OWN]]
