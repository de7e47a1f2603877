"""The job's state tells the truth through a recovery, with real agents, torchrun and faults.

RUNNING means steps are being made: after a worker SIGKILL, and after a node's agent is
SIGKILLed with its tree under a two-node job, the job is RECOVERING from the moment the
fault is noticed, its reason naming what it recovers from, and RUNNING again only at a step
that the new group made (the "training again" event names it; rank 0's log shows it in its
new run), after the event of the group forming. A poller samples the job view every 50 ms.
The replaced attempt's torchrun shutdown (a traceback of torch's own) stays out of the log.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest

from tests.helpers.elastic import log_items, submit, wait_nodes
from tests.helpers.faults import events_of, runs, train_spec, wait_workers
from tests.helpers.processes import pid_alive, wait_for
from worker.torchrun import starts_shutdown

pytestmark = pytest.mark.integration

_TRAINING = re.compile(r"^training again: world size (\d+) on (\d+) node\(s\), step (\d+)$")


class Sampler:
    """The job view every 50 ms in a thread: (time, state, reason, regrouping, attempt)."""

    def __init__(self, api, job_id: str):
        self.samples: list[tuple[float, str, str, bool, int]] = []
        self._api, self._job_id, self._stop = api, job_id, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            got = self._api.get(f"/v1/jobs/{self._job_id}")
            if got.status_code == 200:
                j = got.json()
                self.samples.append((time.time(), j["state"], j["reason"], j["regrouping"], j["attempt"]))

    def stop(self) -> list[tuple[float, str, str, bool, int]]:
        self._stop.set()
        self._thread.join(5)
        return self.samples


def check_recovery(api, job_id: str, samples, killed_at: float, world: int, nodes: int) -> dict:
    """The events and samples of one recovery after `killed_at`; returns its RUNNING event."""
    evs = [e for e in events_of(api, job_id) if e["time"] >= killed_at - 0.5]
    states = [e["state"] for e in evs]
    assert "RECOVERING" in states, evs
    first = states.index("RECOVERING")
    back = next(i for i, e in enumerate(evs) if e["state"] == "RUNNING" and i > first)
    again = evs[back]
    m = _TRAINING.match(again["reason"])
    assert m and (int(m.group(1)), int(m.group(2))) == (world, nodes), again
    # the group formed before, and was not yet "training again"
    formed = [e for e in evs[first:back] if e["reason"].startswith("group formed:")]
    assert formed and all(e["state"] == "RECOVERING" for e in evs[first:back]), evs
    # the step it names was made by the new group: rank 0's log shows it in its last run
    step = int(m.group(3))
    wait_for(lambda: step in runs(api, job_id)[-1][1], 10, f"rank 0's log to show step {step}")
    assert step > runs(api, job_id)[-1][0], (step, runs(api, job_id))
    # the samples: RUNNING, then RECOVERING (regrouping), then RUNNING again from that event on
    after = [s for s in samples if s[0] >= killed_at]
    seen = [s[1] for s in after]
    rec = seen.index("RECOVERING")
    assert "RUNNING" in seen[rec:], seen
    assert all(s[3] for s in after if s[1] == "RECOVERING")
    first_back = after[rec + seen[rec:].index("RUNNING")]
    assert first_back[0] >= again["time"] - 0.05 and not first_back[3], (first_back, again)
    return again


def torchrun_tracebacks(api, job_id: str) -> list[str]:
    """torchrun's own lines (no rank) that belong to a traceback of its shutdown."""
    return [i["line"] for i in log_items(api, job_id) if i["rank"] is None
            and any(w in i["line"] for w in ("Traceback", "RendezvousGoneError", "SignalException",
                                               "torch.distributed.elastic"))]


def test_a_worker_sigkill_is_recovering_until_the_new_groups_first_step(api, agents):
    (a,) = agents(1)
    wait_nodes(api, 1)
    job_id = submit(api, train_spec("truthw", 2000, every=1000))
    wait_for(lambda: (r := runs(api, job_id)) and len(r[0][1]) >= 5, 60, "five steps")
    sampler = Sampler(api, job_id)
    (victim,) = wait_workers(a, 1)
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: not pid_alive(victim), 10, "the SIGKILLed worker to die")
    wait_for(lambda: any(_TRAINING.match(e["reason"]) for e in events_of(api, job_id)), 60,
             "training again")
    wait_for(lambda: sampler.samples[-1][1] == "RUNNING", 10, "a RUNNING sample")
    samples = sampler.stop()
    check_recovery(api, job_id, samples, killed_at, world=1, nodes=1)
    assert any(s[1] == "RECOVERING" and s[2] == "node n0 is restarting its workers" for s in samples)
    assert api.post(f"/v1/jobs/{job_id}/cancel").status_code == 202


def test_a_lost_node_is_recovering_at_once_and_named_until_the_survivors_step(api, agents):
    (a, b) = agents(2)
    wait_nodes(api, 2)
    job_id = submit(api, train_spec("truthn", 2000, mn=1, mx=2, every=1000))
    wait_for(lambda: api.get(f"/v1/jobs/{job_id}").json()["world_size"] == 2, 60, "world size 2")
    wait_for(lambda: (r := runs(api, job_id)) and len(r[-1][1]) >= 5, 60, "five steps at world size 2")
    wait_workers(b, 1)
    sampler = Sampler(api, job_id)
    killed_at = time.time()
    killed = b.kill_tree()
    wait_for(lambda: not any(pid_alive(p) for p in killed), 10, "every process of agent n1 to die")
    wait_for(lambda: any(_TRAINING.match(e["reason"]) and e["time"] > killed_at
                         for e in events_of(api, job_id)), 60, "training again on n0")
    wait_for(lambda: sampler.samples[-1][1] == "RUNNING", 10, "a RUNNING sample")
    samples = sampler.stop()
    again = check_recovery(api, job_id, samples, killed_at, world=1, nodes=1)
    recovering = next(e for e in events_of(api, job_id) if e["state"] == "RECOVERING")
    assert recovering["time"] - killed_at < 5, recovering  # noticed from the dropped connection
    lost = wait_for(lambda: next((e for e in events_of(api, job_id)
                                  if e["reason"] == "node n1 lost (its agent's connection closed)"), None), 15,
                      "n1 lost, from its dropped connection")
    evs = events_of(api, job_id)
    if lost["time"] < again["time"]:
        # the control plane knew of the loss while the job recovered: the reason came to name it
        assert any("n1" in e["reason"] and "lost" in e["reason"] for e in evs
                   if e["state"] == "RECOVERING" and e["time"] < again["time"]), evs
        if again["time"] - lost["time"] > 0.5:
            assert any(s[1] == "RECOVERING" and "n1 lost" in s[2] for s in samples), evs
    else:  # n0's torchrun found the dead peer first and trained on before the lease went
        assert {s[2] for s in samples if s[1] == "RECOVERING"} == {"node n0 is restarting its workers"}, evs
    assert again["reason"] == samples[-1][2]
    if samples[-1][4] > samples[0][4]:
        # n0's replaced attempt: its torchrun's SIGTERM traceback is one line, not the job's
        # output. (The agent hears of the new attempt at once, so under load torchrun may be
        # killed at the end of its 0.3 s grace before it wrote a line of its shutdown: then
        # there is nothing to hide, and none of its shutdown may have reached the job's log.)
        old = samples[0][4]
        hidden = f"ftrain: attempt {old}'s torchrun on n0 shut down"
        try:
            wait_for(lambda: any(i["line"].startswith(hidden) for i in log_items(api, job_id)), 10,
                     "the line that stands for the replaced torchrun's shutdown")
        except AssertionError as exc:
            own = [(i["node"], i["attempt"], i["line"]) for i in log_items(api, job_id) if i["rank"] is None]
            if any(a == old and n == "n0" and starts_shutdown(line) for n, a, line in own):
                raise AssertionError(f"{exc}; torchrun's own lines: {own}") from None
    assert torchrun_tracebacks(api, job_id) == []
    assert api.post(f"/v1/jobs/{job_id}/cancel").status_code == 202
