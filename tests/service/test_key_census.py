"""The soak's key census (bench/key_census.py): pure counting of etcd keys by kind and owner."""

from bench.key_census import census

KEYS = ["/ftrain/jobs/long-aaaaaa", "/ftrain/jobs/s1-bbbbbb", "/ftrain/jobs/s2-cccccc",
        "/ftrain/events/long-aaaaaa/0000000001", "/ftrain/events/s2-cccccc/0000000001",
        "/ftrain/rdzv/long-aaaaaa-a3/state", "/ftrain/rdzv/long-aaaaaa-a3/store/eA",
        "/ftrain/rdzv/long-aaaaaa-a2/ops/x1", "/ftrain/memory/s2-cccccc/n1",
        "/ftrain/memory/x9-dddddd/n1", "/ftrain/nodes/n1", "/ftrain/presence/n1",
        "/ftrain/leader", "/ftrain/idempotency/abc"]


def test_census_counts_keys_by_kind_and_whose_job_they_are():
    ended_at = {"s1-bbbbbb": None, "s2-cccccc": 100.0}
    got = census(KEYS, "/ftrain", "long-aaaaaa", ended_at, now=400.0, stale_s=200.0)
    assert got == {"events/expired": 1, "events/long": 1, "idempotency": 1, "jobs/expired": 1,
                   "jobs/long": 1, "jobs/open": 1, "leader": 1, "memory/expired": 1, "memory/gone": 1,
                   "nodes": 1, "presence": 1, "rdzv/long/cur/state": 1, "rdzv/long/cur/store": 1,
                   "rdzv/long/old/ops": 1}


def test_census_calls_a_job_ended_until_it_is_stale():
    got = census(["/ftrain/jobs/s2-cccccc"], "/ftrain", None, {"s2-cccccc": 100.0}, now=250.0, stale_s=200.0)
    assert got == {"jobs/ended": 1}
