"""EtcdStore against a real etcd: failures surface as StoreUnavailable, never as
anything a handler would turn into a 500. (What every KeyValue does: tests/contract.)"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from service.errors import HistoryCompacted, StoreFull, StoreUnavailable
from service.store.etcd import EtcdStore
from tests.helpers.processes import wait_for
from worker.procs import state_of
from worker.protocol import Timeouts


def test_requests_in_flight_when_the_client_is_dropped_get_store_unavailable(etcd):
    """A hung etcd (SIGSTOP): the first request to time out drops the client, whose
    channel's closing cancels the requests still in flight on it; they must come out as
    StoreUnavailable (a 503), not as CancelledError (a 500)."""

    async def main() -> list[BaseException | None]:
        client = EtcdStore(etcd.endpoint, timeout_s=1)
        await client.put("/t/x", b"1")
        etcd.proc.send_signal(signal.SIGSTOP)
        # kill() only queues the stop: on a busy machine etcd can still answer a request or
        # two before it is scheduled out. Start once it is really stopped.
        wait_for(lambda: state_of(etcd.proc.pid) in ("T", "t"), timeout_s=10,
                 what="etcd to stop on SIGSTOP")
        try:
            async def one() -> BaseException | None:
                try:
                    await client.get("/t/x")
                except BaseException as exc:  # noqa: BLE001 - what escapes is the point
                    return exc
                return None

            first = [asyncio.create_task(one()) for _ in range(10)]
            # A second wave, started half-way through the first one's deadline, is still in
            # flight when the first wave times out and drops the client.
            await asyncio.sleep(0.7)
            second = [asyncio.create_task(one()) for _ in range(10)]
            results = await asyncio.gather(*first, *second)
        finally:
            etcd.proc.send_signal(signal.SIGCONT)
        await client.close()
        return results

    results = asyncio.run(main())
    assert all(isinstance(r, StoreUnavailable) for r in results), \
        sorted({type(r).__name__ for r in results})


def test_a_watch_on_a_dropped_client_ends_with_store_unavailable(etcd):
    async def main() -> None:
        client = EtcdStore(etcd.endpoint, timeout_s=2)
        start = await client.revision() + 1

        seen = asyncio.Event()

        async def watch() -> None:
            async for _ in client.watch_prefix("/w/", start):
                seen.set()

        task = asyncio.create_task(watch())
        await client.put("/w/open", b"1")
        await asyncio.wait_for(seen.wait(), 10)  # the watch is open and delivering
        etcd.kill()
        with pytest.raises(StoreUnavailable):
            await client.get("/w/a")  # fails and drops the client
        with pytest.raises(StoreUnavailable):
            await asyncio.wait_for(task, 10)
        await client.close()

    asyncio.run(main())


def test_a_watch_from_a_compacted_revision_leaves_the_client_and_its_other_watches_alone(etcd):
    """HistoryCompacted is an answer, not an outage: dropping the client for it would break
    every other watch and request on it (the job index's, the rendezvous long polls)."""

    async def main() -> None:
        client = EtcdStore(etcd.endpoint, timeout_s=2)
        await client.put("/w/a", b"1")
        early = await client.revision()
        await client.put("/w/a", b"2")
        await client.compact(await client.revision())
        live = client.watch_prefix("/w/", await client.revision() + 1)
        first = asyncio.ensure_future(anext(live))
        await asyncio.sleep(0.2)  # the live watch is set up
        with pytest.raises(HistoryCompacted):
            await anext(client.watch_prefix("/w/", early))
        await client.put("/w/b", b"3")
        event = await asyncio.wait_for(first, 5)
        assert (event.key, event.value) == ("/w/b", b"3")
        await live.aclose()
        await client.close()

    asyncio.run(main())


def test_check_ready_raises_store_full_while_the_nospace_alarm_is_raised(etcd):
    async def main() -> None:
        import aetcd

        client = EtcdStore(etcd.endpoint, timeout_s=2)
        await client.check_ready()
        raw = aetcd.Client(host=etcd.host, port=etcd.client_port)
        await raw.connect()
        await raw.create_alarm()  # NOSPACE, as a full database raises it
        try:
            with pytest.raises(StoreFull, match="NOSPACE alarm"):
                await client.check_ready()
            with pytest.raises(StoreFull, match="alarm disarm"):
                await client.put("/w/x", b"1")
            assert await client.get("/w/x") is None  # reads go on
        finally:
            for alarm in [a async for a in raw.list_alarms()]:
                await raw.disarm_alarm(alarm.member_id)
            await raw.close()
        await client.check_ready()
        await client.put("/w/x", b"1")
        await client.close()

    asyncio.run(main())


def test_a_lease_id_outside_int64_is_no_lease_and_leaves_no_waiter(etcd):
    async def main():
        client = EtcdStore(etcd.endpoint, timeout_s=2)
        try:
            lease = await client.grant_lease(10)
            assert await client.refresh_lease(lease)
            assert not await client.refresh_lease(2**63)
            assert not await client.refresh_lease(-1)
            assert client.calls.keepalive is not None and client.calls.keepalive._waiters == {}
            # A write protobuf refuses (the guard above bypassed) leaves no future behind either.
            with pytest.raises(ValueError):
                await client.calls.keepalive.refresh(2**64)
            assert client.calls.keepalive._waiters == {}
            assert await client.refresh_lease(lease)  # the stream still works
        finally:
            await client.close()

    asyncio.run(main())


def test_a_keep_alive_written_to_a_closed_stream_is_store_unavailable_not_a_500(etcd):
    """Under load a dropped client closes its keep-alive stream while heartbeats wait to
    write on it; such a write raised InvalidStateError ('RPC already finished'), which came
    out of the heartbeat as a 500 (bench/api.py's submissions at load 13)."""
    async def main():
        client = EtcdStore(etcd.endpoint, timeout_s=2)
        try:
            lease = await client.grant_lease(10)
            assert await client.refresh_lease(lease)
            stream = client.calls.keepalive
            stream._call.cancel()  # what closing the dropped client's channel does to it
            with pytest.raises(ConnectionError):
                await stream.refresh(lease)
            assert stream._waiters == {}
            assert await client.refresh_lease(lease)  # a new stream
        finally:
            await client.close()

    asyncio.run(main())


def test_a_request_to_a_member_whose_port_is_closed_goes_to_the_next_member_at_once(etcd):
    """Several endpoints (one cluster's members): the first is down (a killed member: its
    port refuses connections); requests still succeed, on the next one, none failing."""
    from service.embedded import free_port

    async def main() -> None:
        client = EtcdStore(f"http://127.0.0.1:{free_port()},{etcd.endpoint}", timeout_s=2)
        try:
            await client.put("/t/failover", b"1")  # the first request of all, refused by the first
            assert (await client.get("/t/failover")).value == b"1"
            assert client.endpoint == etcd.endpoint.removeprefix("http://")
        finally:
            await client.close()

    asyncio.run(main())


def test_a_read_on_a_member_that_does_not_answer_goes_to_the_next_within_the_deadline(etcd, tmp_path):
    """A member that is there but does not answer (SIGSTOP: its port still takes connections;
    as a follower waiting on a killed leader does) holds a read only half the deadline: the
    read is then asked of the next member and answered. (Before, it waited the whole deadline
    and failed: the 503s of the hour-long soak when the first etcd member was killed.) The two
    members here are two one-member etcds, the key written to each."""
    from tests.conftest import _started_etcd, _stop_etcd

    other = _started_etcd(tmp_path / "other")

    async def main() -> float:
        client = EtcdStore(f"{etcd.endpoint},{other.endpoint}", timeout_s=2)
        second = EtcdStore(other.endpoint, timeout_s=2)
        try:
            await client.put("/t/where", b"first")  # connected to the first member
            await second.put("/t/where", b"second")
            os.kill(etcd.proc.pid, signal.SIGSTOP)
            try:
                wait_for(lambda: state_of(etcd.proc.pid) in ("T", "t"), 5, "the first member stopped")
                got = await client.get("/t/where")
            finally:
                os.kill(etcd.proc.pid, signal.SIGCONT)
            assert got is not None and got.value == b"second"
        finally:
            await client.close()
            await second.close()

    try:
        asyncio.run(main())
    finally:
        _stop_etcd(other)


def test_a_lone_endpoint_that_refuses_still_fails_as_store_unavailable():
    from service.embedded import free_port

    async def main() -> None:
        client = EtcdStore(f"http://127.0.0.1:{free_port()}", timeout_s=1)
        try:
            with pytest.raises(StoreUnavailable):
                await client.get("/t/x")
        finally:
            await client.close()

    asyncio.run(main())


def test_a_cancellation_that_comes_as_a_call_ends_is_not_lost():
    """A task cancelled just as its etcd call finishes stays cancelled. (`asyncio.wait_for`
    in Python 3.11 returns the call's result and drops the cancellation: a stopping control
    plane's task that was in such a call never ended.) No etcd is needed: the call is given a
    client, and cancels its own task as it returns."""

    async def main() -> str:
        store = EtcdStore("http://127.0.0.1:9", timeout_s=1)

        async def connected():
            return object()

        store.calls.connected = connected
        me = asyncio.current_task()

        async def call(client):
            me.cancel()
            return "answer"

        got = await store.calls.call_once("a call", call)
        await asyncio.sleep(0)  # the cancellation, if it was kept, comes here
        return got

    async def run() -> None:
        task = asyncio.create_task(main())
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())


def test_a_multi_set_that_names_a_key_twice_takes_its_last_value(etcd):
    """etcd refuses a transaction that puts one key twice ('duplicate key given in txn
    request': a 503 before); setting them one by one would leave the last value."""
    from service.keys import Keys
    from service.rendezvous import Rendezvous

    async def main():
        client = EtcdStore(etcd.endpoint, timeout_s=2)
        try:
            rdzv = Rendezvous(client, Keys(), "j-a1", long_poll_s=Timeouts().long_poll_s)
            await rdzv.set([("k", b"1"), ("other", b"x"), ("k", b"2")])
            assert await rdzv.get(["k", "other"], 0) == [b"2", b"x"]
        finally:
            await client.close()

    asyncio.run(main())
