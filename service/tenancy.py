"""Teams and quotas as etcd holds them, kept in memory from a watch.

A user's team and quota are fields of its record (`users/<name>`, service.users); a team's
quota is a key of its own (`teams/<name>`), written by the first `PATCH /v1/teams/{team}`.
Every change is a compare-and-set on the record's revision. Each control plane follows both
prefixes (`run`), so the scheduler's passes, `GET /v1/queue`, the jobs' waiting reasons and
`/metrics` read them from memory (`tenants`); until the watch has loaded, they are read
from etcd (`current`). A change wakes whoever asked (`wake_on_change`): a quota raised lets a
waiting job start at the scheduler's next pass.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from service.decide.quotas import Quota, Tenants
from service.errors import UserNotFound
from service.follow import follow_prefix
from service.keys import Keys
from service.models import QuotaPatch, TeamRecord, UserRecord
from service.store.api import KeyValue, Put, WatchEvent


def tenants_of(users: list[UserRecord], teams: list[TeamRecord]) -> Tenants:
    """The scheduler's view of these records (`decide.quotas.Tenants`)."""
    def quota(r: UserRecord | TeamRecord) -> Quota | None:
        return None if r.max_nodes is None and r.max_gpus is None else Quota(r.max_nodes, r.max_gpus)

    return Tenants(team_of={u.name: u.team for u in users if u.team},
                   users={u.name: q for u in users if (q := quota(u)) is not None},
                   teams={t.name: q for t in teams if (q := quota(t)) is not None})


class Tenancy:
    def __init__(self, kv: KeyValue, keys: Keys):
        self.kv = kv
        self.keys = keys
        self._users: dict[str, UserRecord] = {}
        self._teams: dict[str, TeamRecord] = {}
        self._users_ready = asyncio.Event()
        self._teams_ready = asyncio.Event()
        self._tenants: Tenants | None = None  # made from the records on first use after a change
        self._wakes: list[asyncio.Event] = []
        self.changes = 0  # counted, so that a loop can tell a change from none

    def wake_on_change(self, event: asyncio.Event) -> None:
        """Set `event` whenever a user's or a team's record changes."""
        self._wakes.append(event)

    @property
    def ready(self) -> bool:
        return self._users_ready.is_set() and self._teams_ready.is_set()

    def tenants(self) -> Tenants | None:
        """Teams and quotas as the watch has them (no I/O); None until it has loaded."""
        if not self.ready:
            return None
        if self._tenants is None:
            self._tenants = tenants_of(list(self._users.values()), list(self._teams.values()))
        return self._tenants

    async def current(self) -> Tenants:
        """`tenants`, or etcd's own records while the watch has not loaded."""
        if (known := self.tenants()) is not None:
            return known
        users, teams = await self.records()
        return tenants_of(users, teams)

    async def records(self) -> tuple[list[UserRecord], list[TeamRecord]]:
        """The users' and the teams' records, as etcd has them now."""
        return ([UserRecord.model_validate_json(e.value) async for e in self.kv.scan_prefix(self.keys.users)],
                [TeamRecord.model_validate_json(e.value) async for e in self.kv.scan_prefix(self.keys.teams)])

    async def set_user_quota(self, name: str, change: QuotaPatch) -> UserRecord:
        """Apply `change` to user `name`'s quota (UserNotFound if there is no such user)."""
        def missing() -> UserRecord:
            raise UserNotFound(name)

        return await self._patch(self.keys.user(name), UserRecord, change, missing)

    async def set_team_quota(self, team: str, change: QuotaPatch) -> TeamRecord:
        """Apply `change` to `team`'s quota (its record is made by the first change)."""
        return await self._patch(self.keys.team(team), TeamRecord, change, lambda: TeamRecord(name=team))

    async def _patch(self, key: str, model: type, change: QuotaPatch, absent: Callable[[], object]):
        while True:  # compare-and-set on the record's revision; on a lost race, read again
            entry = await self.kv.get(key)
            record = absent() if entry is None else model.model_validate_json(entry.value)
            new = record.model_copy(update=change.applied_to(record))
            if await self.kv.commit({key: 0 if entry is None else entry.mod_revision},
                                    [Put(key, new.model_dump_json().encode())]):
                return new

    async def run(self) -> None:
        """Follow the users' and the teams' records. Runs until cancelled."""
        await asyncio.gather(
            follow_prefix(self.kv, self.keys.users, self._loader(self.keys.users, self._users, UserRecord),
                          self._applier(self._users, UserRecord), self._users_ready, "users' quotas",
                          self._notify),
            follow_prefix(self.kv, self.keys.teams, self._loader(self.keys.teams, self._teams, TeamRecord),
                          self._applier(self._teams, TeamRecord), self._teams_ready, "teams' quotas",
                          self._notify))

    def _loader(self, prefix: str, into: dict, model: type):
        async def load() -> int:
            revision = await self.kv.revision()
            records = [model.model_validate_json(e.value) async for e in self.kv.scan_prefix(prefix)]
            into.clear()
            into.update((r.name, r) for r in records)
            return revision
        return load

    def _applier(self, into: dict, model: type):
        def apply(ev: WatchEvent, name: str) -> None:
            if ev.value is None:
                into.pop(name, None)
            else:
                into[name] = model.model_validate_json(ev.value)
        return apply

    async def _notify(self) -> None:
        self._tenants = None
        self.changes += 1
        for event in self._wakes:
            event.set()
