"""A short soak (bench/soak.py with tiny numbers): real etcd, a real control plane with a
retention of a few seconds, a real agent training a long job and another running short jobs,
fake nodes over the node API for volume. Nothing is lost, nothing answers 5xx, and
retention deletes finished jobs while the run goes on. (Speed is bench/soak.py's to measure.)"""

from __future__ import annotations

from bench.soak import options, run_soak


def test_soak_loses_no_line_answers_no_5xx_and_retention_deletes_finished_jobs(tmp_path):
    args = options(["--jobs", "40", "--log-mb", "4", "--burst-every", "20", "--log-cap-mb", "0.25",
                    "--retention", "3", "--compaction", "1", "--fake-nodes", "3", "--real-nodes", "1",
                    "--readers", "1", "--read-pause", "0.05", "--max-s", "150"])
    result = run_soak(args, tmp_path)
    totals, last = result["totals"], result["rows"][-1]

    assert totals["http_5xx"] == 0, totals["errors"]
    assert totals["lines_lost"] == 0, totals["errors"]
    assert totals["jobs_failed"] == 0, totals["errors"]
    # Logs were read back whole (uncut ones) and cut by the cap (the bursts).
    assert totals["lines_expected"] > 0 and totals["logs_cut"] >= 1, totals
    # The real path ran too: a real agent ran short jobs, the long job trained with progress.
    assert totals["real_jobs"] >= 1, totals
    assert result["long_job"]["state"] == "RUNNING" and result["long_job"]["progress"]["step"] > 0
    # Retention deleted finished jobs during the run: at some point the job list held fewer
    # jobs than had finished (the first job's 404 says it too, unless that job is one of the real
    # node's and ended last: seen once, the run over 3 s after its end), and far fewer at the end
    # than were submitted.
    assert any(row["first_job_deleted"] or row["jobs_listed"] < row["jobs_done"] for row in result["rows"]), \
        [(row["jobs_done"], row["jobs_listed"], row["first_job_deleted"]) for row in result["rows"]]
    assert last["jobs_listed"] < args.jobs
