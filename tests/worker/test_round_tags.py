"""Each worker line is shipped with the rendezvous round of the group whose worker printed it:
torchrun's rendezvous handler puts each round formed in the environment of that group's workers
(FTRAIN_ROUND), each worker's launcher notes it beside the worker's output files with the
worker's rank, and the agent tags the lines of those files with them. The control plane then
tells a replaced group's late lines from the new group's (`service.decide.recovery.first_output`)."""

from __future__ import annotations

import os
from types import SimpleNamespace

from tests.worker.group_output import Exited, follow, write_worker
from worker.env import FTRAIN_ROUND
from worker.rendezvous.rounds import ReportingHandler
from worker.torchrun import WorkerGroup


def test_the_agent_tags_worker_lines_with_the_rank_and_round_their_launcher_noted(tmp_path):
    logs = tmp_path / "logs"
    write_worker(logs, 0, 0, ["epoch 1"], rank=2, round_=0)
    write_worker(logs, 0, 1, ["epoch 1"], rank=3, round_=0)
    write_worker(logs, 1, 0, ["epoch 2"], rank=0, round_=3)  # torch restarted the group: round 3
    write_worker(logs, 1, 1, ["oops"], rank=1, round_=3, stream="stderr")
    lines = follow(tmp_path, WorkerGroup("j", 2, Exited()),
                   {"stdout": "W torchrun starting\nI restarting the workers\n"})
    got = sorted((x.rank if x.rank is not None else -1, x.stream, x.line, x.round) for x in lines)
    assert got == [(-1, "stdout", "I restarting the workers", None),
                   (-1, "stdout", "W torchrun starting", None),
                   (0, "stdout", "epoch 2", 3), (1, "stderr", "oops", 3),
                   (2, "stdout", "epoch 1", 0), (3, "stdout", "epoch 1", 0)]


def test_a_worker_without_a_note_is_its_local_rank_of_no_known_round(tmp_path):
    write_worker(tmp_path / "logs", 0, 1, ["hello"])
    assert [(x.rank, x.line, x.round) for x in follow(tmp_path, WorkerGroup("j", 2, Exited()))] == [
        (1, "hello", None)]


class Reporter:
    node = "n1"

    def __init__(self):
        self.reports = []

    def report(self, phase, call, info=None, round_=None):
        self.reports.append((phase, call, round_))

    def report_soon(self, phase, call):  # the real one sends it from a thread
        self.report(phase, call)


class Dynamic:
    """torch's DynamicRendezvousHandler as far as the round goes."""

    def __init__(self, round_: int):
        self._state_holder = SimpleNamespace(state=SimpleNamespace(round=round_))

    def next_rendezvous(self):
        return SimpleNamespace(rank=0, world_size=2)


def test_the_handler_gives_each_round_formed_to_its_workers_and_reports_it(monkeypatch, capsys):
    monkeypatch.setenv(FTRAIN_ROUND, "1")  # a round before (and undone after the test)
    reporter = Reporter()
    ReportingHandler(Dynamic(4), reporter).next_rendezvous()
    assert os.environ[FTRAIN_ROUND] == "4"  # torch passes its environment to the workers it starts
    assert capsys.readouterr() == ("", "")  # nothing in torchrun's output
    assert reporter.reports == [("joining", 0, None), ("joined", 0, 4)]
