"""Where the dashboard marks a job's regroups on its curves (`service/ui/static/marks.js`),
from its events and metric history, run in Node: a table of event sequences with the reasons
the control plane writes (`service.decide.scheduling`, `rounds`, `recovery`, `restore`) and
the marks each gives. The browser test (tests/integration/test_dashboard.py) shows a real
restart, scale-up and drain marked on the page; this covers the causes it does not reach."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from service.routes.ui import UI_DIR

NODE = shutil.which("node") or shutil.which("nodejs")
pytestmark = pytest.mark.skipif(NODE is None, reason="needs Node.js (apt-get install nodejs)")

# Loads marks.js as the page does (a classic script), then prints regroupMarks' answer as
# [kind, step, [the seq of each event of the regroup]] for the events and history on stdin.
RUN = """
const vm = require("vm"), fs = require("fs");
const context = vm.createContext({});
vm.runInContext(fs.readFileSync(process.argv[1], "utf8"), context);
context.input = JSON.parse(fs.readFileSync(0, "utf8"));
console.log(JSON.stringify(vm.runInContext(
  "regroupMarks(input.events, input.history).map(m => [m.kind, m.step, m.events.map(e => e.seq)])",
  context)));
"""

# Points at steps 10, 20, ... 100, at times 1, 2, ... 10.
HISTORY = {"steps": list(range(10, 101, 10)), "times": [float(t) for t in range(1, 11)],
           "series": {}, "stride": 1}
TRAINING = ("RUNNING", "training: world size 1 on 1 node(s), step 1")
AGAIN = ("RUNNING", "training again: world size 1 on 1 node(s), step 31")


def marks_of(events: list[tuple[float, str, str]]) -> list[tuple]:
    """The marks of `events` (time, state, reason; their seq: 1, 2, ...) on HISTORY."""
    items = [{"seq": i, "time": t, "state": state, "reason": reason}
             for i, (t, state, reason) in enumerate(events, 1)]
    out = subprocess.run([NODE, "-e", RUN, str(UI_DIR / "static" / "marks.js")], check=True,
                         input=json.dumps({"events": items, "history": HISTORY}),
                         capture_output=True, text=True, timeout=30)
    return [tuple(m) for m in json.loads(out.stdout)]


CASES = {
    "a worker restart: one mark, at the newest point when the job went RECOVERING": (
        [(0.5, *TRAINING), (3.5, "RECOVERING", "node n0 is restarting its workers"),
         (3.6, "RECOVERING", "workers restarted after a failure (1 of 3)"),
         (3.7, "RECOVERING", "attempt 1 resumes from the disk snapshot at step 30"), (4.2, *AGAIN)],
        [("restart", 30, [2, 3, 4, 5])]),
    "a lost node: its note, the restart it causes and the new attempt are one mark": (
        [(0.5, *TRAINING), (5.0, "RUNNING", "node n1 lost (its lease lapsed)"),
         (5.1, "RECOVERING", "node(s) n1 lost: restarting the 1 remaining from the last snapshot"),
         (5.5, "RECOVERING", "attempt 2 resumes from step 50 in the memory of n0 (disk's latest: 50)"),
         (6.5, *AGAIN)],
        [("lost", 50, [2, 3, 4, 5])]),
    "a scale-up and then a drain (its new attempt with it): two marks": (
        [(0.5, *TRAINING), (2.5, "RUNNING", "node(s) n1 joined; scaling up"), (3.5, *AGAIN),
         (7.2, "RUNNING", "node(s) n1 drained; the others go on from the last snapshot"),
         (8.1, "RUNNING", "attempt 2 resumes from step 80 in the memory of n0 (disk's latest: 80)"),
         (8.5, *AGAIN)],
        [("scale-up", 20, [2, 3]), ("drain", 70, [4, 5, 6])]),
    "a new attempt with no other cause (a planned change called off): marked as one": (
        [(0.5, *TRAINING),
         (6.2, "RUNNING", "the planned change was called off; restarting from the committed snapshot"),
         (6.3, "RUNNING", "attempt 2 resumes from the disk snapshot at step 60 (no copy in memory)"),
         (6.8, *AGAIN)],
        [("attempt", 60, [3, 4])]),
    "a fault before the first point: nothing on the curve to mark": (
        [(0.2, "STARTING", "started on 1 node(s): n0"),
         (0.5, "STARTING", "node n0 lost (its lease lapsed)"), (1.5, *TRAINING)],
        []),
    "two regroups with no point between them: one mark naming both": (
        [(0.5, *TRAINING), (4.1, "RUNNING", "node(s) n1 joined; scaling up"), (4.3, *AGAIN),
         (4.6, "RECOVERING", "node n0 is restarting its workers"), (4.9, *AGAIN)],
        [("scale-up", 40, [2, 3, 4, 5])]),
    "the first attempt's restore point and notes that are no regroup: no mark": (
        [(0.2, "STARTING", "started on 1 node(s): n0"),
         (0.3, "STARTING", "attempt 1 starts at step 0 (no snapshot)"), (0.9, *TRAINING),
         (5.0, "RUNNING", "snapshot at step 50 skipped: the previous one is still being written")],
        []),
}


@pytest.mark.parametrize("events,expected", CASES.values(), ids=list(CASES))
def test_regroup_marks(events, expected):
    assert marks_of(events) == expected
