"""torchrun's own shutdown kept out of the job's log: a replaced (or cancelled) attempt's
torchrun traceback becomes one line, a real failure's stays, the workers' lines always go."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.worker.group_output import Exited, follow, write_worker
from worker.torchrun import WorkerGroup, shutdown_summary, starts_shutdown

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


def followed(tmp_path: Path, torchrun_text: str, worker_lines: list[str], stop_requested: bool
             ) -> list[tuple[int | None, str]]:
    """What the agent ships of torchrun's output `torchrun_text` and rank 0's `worker_lines`,
    for a group that has exited."""
    write_worker(tmp_path / "logs", 0, 0, worker_lines, rank=0, round_=0)
    g = WorkerGroup("j", 2, Exited(), stop_requested=stop_requested)
    lines = follow(tmp_path, g, {"stderr": torchrun_text})
    return [(x.rank, x.line) for x in lines]


def test_a_replaced_attempts_torchrun_traceback_is_one_line_and_the_workers_lines_all_go(tmp_path):
    text = "\n".join(["W torchrun starting", *GONE, ""])
    got = followed(tmp_path, text, ["step=1", "bye"], stop_requested=False)
    assert [x for x in got if x[0] == 0] == [(0, "step=1"), (0, "bye")]
    assert [x for x in got if x[0] is None] == [
        (None, "W torchrun starting"),
        (None, "ftrain: attempt 2's torchrun on n1 shut down (4 lines of its own hidden)")]


def test_a_stopped_attempts_own_lines_are_one_line(tmp_path):
    got = followed(tmp_path, "\n".join(["W1127 Received 15 death signal", *OWN, ""]), ["step=1"],
                   stop_requested=True)
    assert sorted(got, key=str) == [
        (0, "step=1"), (None, "ftrain: attempt 2's torchrun on n1 shut down (4 lines of its own hidden)")]


def test_a_real_failure_keeps_torchruns_traceback(tmp_path):
    got = followed(tmp_path, "\n".join([*OWN, ""]), ["step=1"], stop_requested=False)
    assert [x for x in got if x[0] == 0] == [(0, "step=1")]
    assert [x for x in got if x[0] is None] == [(None, x) for x in OWN]
