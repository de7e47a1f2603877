"""worker/end_record.py and handoff.gather: the end a SIGKILLed agent owed, finished by the
agent restarted in its place (with real processes: tests/faults/test_job_end.py)."""

from __future__ import annotations

import shutil
import threading

import pytest

from service.decide.members import decide_registered
from service.models import JobState
from tests.helpers.processes import wait_for
from tests.service.records import NOW, make_job
from tests.worker.test_handoff import FakeLink, written
from worker import end_record, handoff
from worker.end_record import EndRecord, EndRecords
from worker.protocol import ProgressReport


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch):
    monkeypatch.setattr(handoff, "RETRY_FIRST_S", 0.01)
    monkeypatch.setattr(handoff, "RETRY_MAX_S", 0.02)


class StuckAfter(FakeLink):
    """Commits `n` requests, then blocks in the next one until `release` (the agent 'killed')."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n
        self.stuck = threading.Event()
        self.release = threading.Event()

    def commit_request(self, req, retry_s=None):
        if self.n == 0:
            self.stuck.set()
            self.release.wait(10)
            raise handoff.CommitUnreachable("away")
        self.n -= 1
        return super().commit_request(req, retry_s)


def test_a_taken_file_keeps_only_what_is_left_and_a_restart_gathers_it_with_what_came_since(tmp_path):
    """The agent rewrites its taken file after each commit; a SIGKILL leaves that file, and
    the restarted agent's `gather` puts it back with what the worker left since (whose
    progress report is the newer), in the one file it takes."""
    path = handoff.leave(tmp_path, "n0", 1, commits=[written(tmp_path, 10), written(tmp_path, 20)],
                         progress=ProgressReport(step=20, attempt=1, final=False))
    link = StuckAfter(1)
    h = handoff.AgentHandoff(path, link).start()
    wait_for(link.stuck.is_set, 10, "the first commit made and the second tried")
    (taken,) = [p for p in tmp_path.iterdir() if ".taken-" in p.name]
    commits, progress = handoff.read(taken)
    assert [c.step for c in commits] == [10] and progress.step == 20  # step 20 made: not left
    left = taken.with_name(f"{path.name}.taken-999999")  # what a killed agent leaves
    shutil.copy(taken, left)
    link.release.set()
    h.cancel()
    h.join(10)
    handoff.leave(tmp_path, "n0", 1, progress=ProgressReport(step=21, attempt=1, final=True), finished=True)
    assert handoff.gather(tmp_path, "n0", 1) == path
    commits, progress = handoff.read(path)
    assert [c.step for c in commits] == [10] and progress.step == 21 and progress.final
    assert handoff.read_finished(path)  # the node's word that the run finished, kept
    assert not left.exists()
    assert handoff.gather(tmp_path, "n0", 2) is None  # nothing for another attempt


def record(tmp_path, **kw) -> EndRecord:
    return EndRecord(job_id="j-abc123", attempt=1, snapshot_dir=str(tmp_path), job_token="t", **kw)


def test_the_record_is_kept_whole_and_says_what_a_restart_owes(tmp_path):
    records = EndRecords(tmp_path / "data", "n0")
    (tmp_path / "data").mkdir()
    records.keep(record(tmp_path, outcome=("succeeded", 0, None)))
    assert oct(records.path.stat().st_mode & 0o777) == "0o600"
    again = EndRecords(tmp_path / "data", "n0").load()
    assert again == record(tmp_path, outcome=("succeeded", 0, None))
    assert again.owed("n0")  # an outcome whose report may not have landed
    assert not record(tmp_path).owed("n0")  # killed mid-training: the workers died with it
    handoff.leave(tmp_path, "n0", 1, commits=[written(tmp_path, 10)])
    assert record(tmp_path).owed("n0")  # a hand-over left
    assert not record(tmp_path, stop_requested=True).owed("n0")  # the control plane stopped it
    records.drop()
    assert EndRecords(tmp_path / "data", "n0").load() is None


def test_a_restart_reports_the_outcome_recorded_or_stopped_when_the_exit_was_never_seen(
        tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    records = EndRecords(data, "n0")
    records.keep(record(tmp_path))  # no outcome, nothing left: dropped, the usual restart
    assert end_record.recover(records, "http://127.0.0.1:9") is None and not records.path.exists()

    links = []

    def link(*_args, **_kw):
        links.append(FakeLink(refuse_from=10))
        return links[-1]

    monkeypatch.setattr(end_record, "ServiceLink", link)
    handoff.leave(tmp_path, "n0", 1, commits=[written(tmp_path, 10), written(tmp_path, 20)],
                  progress=ProgressReport(step=20, attempt=1, final=True))
    records.keep(record(tmp_path, outcome=("succeeded", 0, None)))
    r = end_record.recover(records, "http://127.0.0.1:9")
    wait_for(r.done, 10, "the commits left")
    state, code, reason = r.outcome()
    assert (state, code) == ("succeeded", 0) and "step 10: refused" in reason  # said, not silent
    assert links[0].calls == [("commit", 20), ("commit", 10)]

    handoff.leave(tmp_path, "n0", 1, commits=[written(tmp_path, 30)])
    records.keep(record(tmp_path))  # torchrun died with the agent (in its exit barrier, say)
    r = end_record.recover(records, "http://127.0.0.1:9")
    wait_for(r.done, 10, "the commits left")
    assert r.outcome() == ("stopped", None, end_record.DIED_WITH_THE_AGENT)


def test_the_control_plane_keeps_a_member_whose_restarted_agent_names_the_attempt():
    """min == max (b finished) and min < max alike: the member is kept until the report lands;
    registering as running nothing fails the first, and stops the node in the second."""
    for members, mn, mx in (({"a": "running", "b": "succeeded"}, 2, 2), ({"a": "running"}, 1, 2)):
        job = make_job(JobState.RUNNING, members, mn=mn, mx=mx)
        assert decide_registered(job, "a", 1, NOW, ("j-abc123", 1)) is None
        assert decide_registered(job, "a", 1, NOW, None).job.members["a"].state in ("failed", "stopped")
