"""A replica cut off from etcd (`KeyValue.check_contact` raises) serves no status from its
watch-fed index, and reading through waits for etcd at most CUT_OFF_READ_S: a 503 then,
which clients fail over on. The real cut: tests/faults/test_leader_cut.py (etcd link only)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from service.errors import StoreUnavailable
from service.routes import jobs as routes


class CutOff:
    def __init__(self) -> None:
        self.cut = True

    def check_contact(self) -> None:
        if self.cut:
            raise StoreUnavailable("no answer from etcd for 1.5 s")


class Ready:
    """An index that is loaded and would answer."""

    def __init__(self) -> None:
        self.ready = self.progress_ready = SimpleNamespace(is_set=lambda: True)
        self.revision = 7

    def view_json(self, job_id: str) -> bytes:
        return b'{"stale": true}'

    def get(self, job_id: str) -> None:
        return None  # (a record it has not: the view above is answered as it is)


def test_a_cut_off_replica_does_not_answer_from_its_index_and_answers_503_soon(monkeypatch):
    monkeypatch.setattr(routes, "CUT_OFF_READ_S", 0.1)
    kv = CutOff()

    async def hangs(job_id: str):
        await asyncio.sleep(3600)

    ctx = SimpleNamespace(kv=kv, index=Ready(), jobs=SimpleNamespace(view=hangs))

    async def main():
        assert await routes.status_from_index(ctx, "j", None) is None
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(StoreUnavailable, match="no answer from etcd"):
            await routes.read_through(ctx, "j")
        assert loop.time() - started < 1.0
        kv.cut = False  # in touch again: the index answers
        assert await routes.status_from_index(ctx, "j", None) == (b'{"stale": true}', 7)

    asyncio.run(main())
