"""Each worker line is shipped with the rendezvous round of the group whose worker printed it:
torchrun's rendezvous handler marks each round formed (on stdout and stderr, before that group's
workers start), and the agent tags the lines after the mark with it, shipping no mark. The
control plane then tells a replaced group's late lines from the new group's
(`service.decide.recovery.first_output`)."""

from __future__ import annotations

from types import SimpleNamespace

from tests.worker.test_shutdown_noise import Exited, Shipper
from worker.protocol import round_mark, round_of_mark
from worker.rendezvous.rounds import ReportingHandler
from worker.torchrun import Torchrun, WorkerGroup


def test_the_agent_tags_worker_lines_with_the_round_marked_before_them(tmp_path):
    out = tmp_path / "out"
    out.write_text("\n".join(["W torchrun starting", round_mark(0), "[rank0]:epoch 1",
                              "[rank1]:epoch 1", "I restarting the workers", round_mark(3),
                              "[rank0]:epoch 2", ""]))
    shipper = Shipper()
    Torchrun("n1", "http://cp", tmp_path, None, shipper)._pump(WorkerGroup("j", 2, Exited()), "stdout", out)
    assert [(x.rank, x.line, x.round) for x in shipper.lines] == [
        (None, "W torchrun starting", None), (0, "epoch 1", 0), (1, "epoch 1", 0),
        (None, "I restarting the workers", None), (0, "epoch 2", 3)]


def test_only_a_mark_names_a_round():
    assert round_of_mark(round_mark(12)) == 12
    assert round_of_mark("ftrain-round-formed: x") is None and round_of_mark("epoch 12") is None


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


def test_the_handler_marks_each_round_formed_and_reports_it(capsys):
    reporter = Reporter()
    ReportingHandler(Dynamic(4), reporter).next_rendezvous()
    out, err = capsys.readouterr()
    assert out == err == round_mark(4) + "\n"
    assert reporter.reports == [("joining", 0, None), ("joined", 0, 4)]
