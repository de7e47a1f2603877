"""What a job's metric history costs etcd: bytes written per progress report, one key
against the body + tail that ftrain stores (service/decide/metrics.py), in the same run.

    .venv/bin/python bench/metric_history.py [--reports 3600] [--steps-per-report 20] [--scalars 1]

Pure computation with the control plane's own decisions (no etcd): a job reports once a
second (`--reports` of them: an hour by default), `--steps-per-report` steps apart, with
loss, samples/s and `--scalars` logged scalars; each stored report adds a point
(`add_point`). "one key" writes the whole history at every point; "body + tail" writes
what `split` says. Prints, for each, the writes, the mean and largest bytes a report
writes (key + JSON value) and the total.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from service.decide.metrics import add_point, merged, split  # noqa: E402
from service.keys import Keys  # noqa: E402
from worker.protocol import MAX_METRICS  # noqa: E402

KEYS = Keys()
JOB = "train-abc123"


def values(i: int, scalars: int) -> dict[str, float]:
    out = {"loss": 2.5 * math.exp(-i / 900) + 0.01 * math.sin(i),
           "samples_per_s": 1500 + 37 * math.cos(i / 7)}
    out.update({f"scalar_{k}": 1e-3 * 0.5 ** (i // 600) * (k + 1) for k in range(scalars)})
    return out


def run(reports: int, steps_per_report: int, scalars: int, capacity: int) -> dict[str, list[int]]:
    written: dict[str, list[int]] = {"one key": [], "body + tail": []}
    one = body = tail = None
    for i in range(1, reports + 1):
        step, now = i * steps_per_report, 1_700_000_000.0 + i
        v = values(i, scalars)
        added = add_point(one, step, now, v, capacity, MAX_METRICS + 2)
        if added is not None:
            one = added
            written["one key"].append(len(KEYS.metrics_body(JOB)) + len(one.model_dump_json()))
        added = add_point(merged(body, tail), step, now, v, capacity, MAX_METRICS + 2)
        if added is not None:
            new_body, tail = split(body, added)
            size = len(KEYS.metrics_tail(JOB)) + len(tail.model_dump_json())
            if new_body is not None:
                body = new_body
                size += len(KEYS.metrics_body(JOB)) + len(body.model_dump_json())
            written["body + tail"].append(size)
        assert merged(body, tail) == one, f"report {i}: the two layouts disagree"
    return written


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reports", type=int, default=3600)
    p.add_argument("--steps-per-report", type=int, default=20)
    p.add_argument("--scalars", type=int, default=1, help="logged scalars besides loss and samples/s")
    p.add_argument("--capacity", type=int, default=240, help="FTRAIN_METRIC_POINTS")
    a = p.parse_args()
    written = run(a.reports, a.steps_per_report, a.scalars, a.capacity)
    print(f"{a.reports} reports, {a.steps_per_report} steps apart, {2 + a.scalars} series, "
          f"{a.capacity} points kept")
    print(f"{'layout':<12} {'writes':>7} {'mean B/report':>14} {'max B':>7} {'total KiB':>10}")
    for name, sizes in written.items():
        print(f"{name:<12} {len(sizes):>7} {sum(sizes) / a.reports:>14.0f} {max(sizes):>7} "
              f"{sum(sizes) / 1024:>10.0f}")


if __name__ == "__main__":
    main()
