"""A flood of user requests on a real control plane: the users over its limit get 429 with
Retry-After, and a node's heartbeats all succeed within its lease (service/admission.py)."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

MAX_IN_FLIGHT = 2
FLOOD_CONNECTIONS = 48  # many times the limit
FLOOD_S = 8.0  # longer than a lease (6 s)
# Each job wants two nodes and there is one: they all wait PENDING (nothing runs).
SPEC = {"name": "flood", "command": ["python", "-c", "pass"], "nodes": {"min": 2, "max": 2}}


async def _flood(url: str, token: str, stop: threading.Event) -> list[tuple[int, str | None]]:
    """Submit jobs from FLOOD_CONNECTIONS connections at once, each at once after its last
    answer (Retry-After ignored, as a careless script does), until `stop`."""
    answers: list[tuple[int, str | None]] = []
    limits = httpx.Limits(max_connections=FLOOD_CONNECTIONS)
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {token}"},
                                 limits=limits, timeout=30) as client:
        async def submitter() -> None:
            while not stop.is_set():
                r = await client.post("/v1/jobs", json=SPEC)
                answers.append((r.status_code, r.headers.get("Retry-After")))

        await asyncio.gather(*(submitter() for _ in range(FLOOD_CONNECTIONS)))
    return answers


@pytest.mark.parametrize("control_plane", [{"FTRAIN_USER_MAX_IN_FLIGHT": str(MAX_IN_FLIGHT)}],
                         indirect=True)
def test_a_flood_of_submissions_gets_429s_while_every_heartbeat_is_answered_within_the_lease(
        control_plane):
    with control_plane.client("node") as c:
        reg = c.post("/v1/nodes/register", json={"name": "n0", "nproc_per_node": 1}).json()
    ttl_s, interval_s = reg["timeouts"]["node_ttl_s"], reg["timeouts"]["heartbeat_interval_s"]
    stop = threading.Event()
    answers: list[tuple[int, str | None]] = []
    flood = threading.Thread(target=lambda: answers.extend(
        asyncio.run(_flood(control_plane.url, control_plane.user_token, stop))))
    beats: list[tuple[float, int, float]] = []  # (sent at, status, took)
    with control_plane.client(reg["credential"]) as node:
        flood.start()
        try:
            end = time.monotonic() + FLOOD_S
            while time.monotonic() < end:
                sent = time.monotonic()
                try:
                    status = node.post("/v1/nodes/n0/heartbeat", json={"lease_id": reg["lease_id"]}).status_code
                except httpx.TimeoutException:
                    status = 0
                beats.append((sent, status, time.monotonic() - sent))
                stop.wait(max(0.0, sent + interval_s - time.monotonic()))
        finally:
            stop.set()
            flood.join(60)

    refused = [retry_after for status, retry_after in answers if status == 429]
    assert refused, f"no 429 among {len(answers)} submissions from {FLOOD_CONNECTIONS} connections"
    assert all(r is not None and int(r) >= 1 for r in refused), "every 429 says when to come back"
    assert any(status == 201 for status, _ in answers), "the flood was still served, at the limit"
    assert {status for status, _ in answers} <= {201, 429}
    with control_plane.client("user") as api:
        metrics = api.get("/metrics").text
    assert f"ftrain_user_requests_refused_total {float(len(refused))}" in metrics
    assert [s for _, s, _ in beats] == [200] * len(beats), "every heartbeat answered 200"
    assert max(took for _, _, took in beats) < ttl_s
    gaps = [b[0] + b[2] - (a[0] + a[2]) for a, b in zip(beats, beats[1:])]
    assert len(beats) >= FLOOD_S / interval_s - 1 and max(gaps) < ttl_s, (gaps, ttl_s)
