"""Admission control (service/admission.py): the limit on user requests, what is node traffic,
and the ASGI layer that answers 429 with Retry-After while node traffic goes through."""

from __future__ import annotations

import asyncio

import pytest

from service.admission import CALM_S, CUT_EVERY_S, RETRY_AFTER_S, Admission, UserLimit, node_traffic
from service.app import create_app
from service.settings import Settings


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_user_requests_beyond_the_limit_are_refused_until_one_is_answered():
    async def main():
        limit = UserLimit(max_in_flight=2, target_lag_s=0.25, clock=Clock())
        assert await limit.admit() and await limit.admit()
        assert not await limit.admit()
        assert limit.refused == 1
        limit.release()
        assert await limit.admit()
        assert limit.in_flight == 2

    asyncio.run(main())


def test_a_request_over_the_limit_waits_for_a_place_in_order_of_arrival():
    async def main():
        limit = UserLimit(max_in_flight=1, target_lag_s=0.25, wait_s=30)
        assert await limit.admit()
        first, second = asyncio.create_task(limit.admit()), asyncio.create_task(limit.admit())
        await asyncio.sleep(0)
        limit.release()
        assert await first and not second.done()
        limit.release()
        assert await second
        return limit

    limit = asyncio.run(main())
    assert (limit.in_flight, limit.refused) == (1, 0)


def test_a_request_that_gets_no_place_within_its_wait_is_refused():
    async def main():
        limit = UserLimit(max_in_flight=1, target_lag_s=0.25, wait_s=0.01)
        assert await limit.admit()
        assert not await limit.admit()
        limit.release()
        assert await limit.admit()  # the place of the one that gave up is not lost
        return limit

    limit = asyncio.run(main())
    assert (limit.in_flight, limit.refused) == (1, 1)


def test_lateness_halves_the_limit_once_per_cut_interval_and_calm_raises_it_by_one():
    clock = Clock()
    limit = UserLimit(max_in_flight=64, target_lag_s=0.25, clock=clock)
    limit.observe_lateness(0.3)
    assert limit.limit == 32
    limit.observe_lateness(2.0)  # the same pause, seen again before CUT_EVERY_S: cut once
    assert limit.limit == 32
    clock.now += CUT_EVERY_S
    limit.observe_lateness(0.3)
    assert limit.limit == 16
    clock.now += CALM_S / 2
    limit.observe_lateness(0.01)  # on time, but something was late less than CALM_S ago
    assert limit.limit == 16
    clock.now += CALM_S / 2
    limit.observe_lateness(0.01)
    limit.observe_lateness(0.25)  # on time (not later than the target)
    assert limit.limit == 18
    for _ in range(100):
        limit.observe_lateness(0.0)
    assert limit.limit == 64


def test_the_limit_never_falls_below_one():
    clock = Clock()
    limit = UserLimit(max_in_flight=4, target_lag_s=0.1, clock=clock)
    for _ in range(10):
        limit.observe_lateness(5.0)
        clock.now += CUT_EVERY_S
    assert limit.limit == 1
    assert asyncio.run(limit.admit())


@pytest.fixture(scope="module")
def traffic(tmp_path_factory):
    """What the control plane's own routes make node traffic."""
    app = create_app(Settings(secret_dir=str(tmp_path_factory.mktemp("secrets"))))
    return node_traffic(app.openapi()["paths"])


@pytest.mark.parametrize("request_line", [
    "POST /v1/nodes/register", "POST /v1/nodes/n0/heartbeat", "GET /v1/nodes/n0/presence",
    "POST /v1/nodes/n0/report", "DELETE /v1/nodes/n0", "PUT /v1/rdzv/j-1-a1/state",
    "POST /v1/rdzv/j-1-a1/store/add", "POST /v1/jobs/j-1/progress", "POST /v1/jobs/j-1/snapshots",
    "POST /v1/jobs/j-1/logs", "GET /v1/jobs/j-1/control", "GET /healthz", "GET /readyz",
])
def test_routes_of_node_and_job_tokens_and_health_probes_are_node_traffic(traffic, request_line):
    assert traffic.match(request_line)


@pytest.mark.parametrize("request_line", [
    "POST /v1/jobs", "GET /v1/jobs", "GET /v1/jobs/j-1", "POST /v1/jobs/j-1/cancel",
    "GET /v1/jobs/j-1/logs", "GET /v1/jobs/j-1/snapshots", "GET /v1/nodes", "POST /v1/nodes/n0/drain",
    "GET /v1/users/me", "GET /ui", "GET /v1/nodes/n0/heartbeat/x", "GET /nowhere",
])
def test_user_routes_and_anything_unknown_are_user_traffic(traffic, request_line):
    assert not traffic.match(request_line)


class App:
    """An ASGI app that answers when told to (`release`), recording what reached it."""

    def __init__(self) -> None:
        self.reached: list[str] = []
        self.go = asyncio.Event()

    async def __call__(self, scope, receive, send) -> None:
        self.reached.append(scope["path"])
        if scope["path"] == "/v1/jobs/streamed":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await self.go.wait()  # the body streams on after the answer has started
            await send({"type": "http.response.body", "body": b"end"})
            return
        await self.go.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


async def _request(layer, method: str, path: str) -> list[dict]:
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    await layer({"type": "http", "method": method, "path": path, "headers": []}, receive, send)
    return sent


PATHS = {"/v1/nodes/{name}/heartbeat": {"post": {"security": [{"nodeCredential": []}]}},
         "/v1/jobs": {"post": {"security": [{"userToken": []}]}},
         "/v1/jobs/streamed": {"get": {"security": [{"userToken": []}]}}}


def test_a_user_request_over_the_limit_gets_429_with_retry_after_while_node_traffic_goes_through():
    async def main():
        app = App()
        layer = Admission(app, UserLimit(1, 0.25), openapi=lambda: {"paths": PATHS})
        first = asyncio.create_task(_request(layer, "POST", "/v1/jobs"))
        await asyncio.sleep(0)
        refused = await _request(layer, "POST", "/v1/jobs")
        beat = asyncio.create_task(_request(layer, "POST", "/v1/nodes/n0/heartbeat"))
        await asyncio.sleep(0)
        app.go.set()
        return app, await first, refused, await beat

    app, first, refused, beat = asyncio.run(main())
    assert first[0]["status"] == 200 and beat[0]["status"] == 200
    assert refused[0]["status"] == 429
    assert (b"retry-after", str(RETRY_AFTER_S).encode()) in refused[0]["headers"]
    assert b"try again" in refused[1]["body"]
    assert app.reached == ["/v1/jobs", "/v1/nodes/n0/heartbeat"]  # the refused one never did


def test_a_streamed_answer_frees_its_place_when_it_starts():
    async def main():
        app = App()
        limit = UserLimit(1, 0.25)
        layer = Admission(app, limit, openapi=lambda: {"paths": PATHS})
        stream = asyncio.create_task(_request(layer, "GET", "/v1/jobs/streamed"))
        await asyncio.sleep(0)
        in_flight_while_streaming = limit.in_flight
        app.go.set()
        await stream
        return in_flight_while_streaming, limit.in_flight

    assert asyncio.run(main()) == (0, 0)
