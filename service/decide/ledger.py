"""Fair share over time: the node-seconds each user's jobs have held at each priority.

Fair share (`decide.shares`) first counted the nodes a user holds now. Jobs hold their nodes
for their whole run, though, so at the moment a node frees every user with work waiting
often holds the same (none), and the tie went to whichever came next in the order, run after
run: on bench/multitenant.py's trace (4 nodes, three users, one of them alone in a team) the
user alone in a team won every such tie on the team's count, and its priority-0 jobs held 991
node-seconds against 600 and 387 for the other two (Jain's index 0.87). What evens out
node-seconds is to count node-seconds: the user whose jobs have held least goes first.

- **Per priority.** Use is counted at each priority apart, as the queue is served (fair share
  orders the waiting jobs of one priority): an urgent job does not cost its owner its share
  of the ordinary queue.
- **Decayed.** Old use counts for less, halving every `half_life_s` (SLURM's fair share does
  the same): what a user ran yesterday does not hold its work back today.
- **No banking.** A user that had no unfinished job at a priority, and now has one, starts
  from the least use of those that have had one meanwhile (as Linux's fair scheduler sets a
  task that wakes to the least virtual run time of the queue): time away earns nothing, so a
  newcomer is not served ahead of everyone until it has caught up with them.

The ledger is fed every change of a job (`change`, by the job index, which every replica
keeps: a replica that takes the lead has the same ledger as the one that led, as long as it
was up meanwhile); between changes what each user holds is constant, so the node-seconds are
exact. Pure but for the time the caller gives it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from service.decide.quotas import held_nodes
from service.models import JobRecord

# Old use counts half as much after this long (`Settings.fair_share_half_life_s`).
HALF_LIFE_S = 3600.0
# A use below this (node-seconds) by a user with nothing unfinished at its priority is forgotten.
FORGET_BELOW = 1.0

Key = tuple[str, int]  # (user, priority)


class Ledger:
    """The decayed node-seconds of each (user, priority), as of the last `accrue`."""

    def __init__(self, half_life_s: float = HALF_LIFE_S):
        self.half_life_s = half_life_s
        self._used: dict[Key, float] = {}
        self._held: Counter[Key] = Counter()  # nodes held now
        self._open: Counter[Key] = Counter()  # unfinished jobs now
        self._at: float | None = None

    def accrue(self, now: float) -> None:
        """Charge what is held now for the time since the last charge, and decay the rest."""
        if self._at is None or now <= self._at:
            self._at = now if self._at is None else self._at
            return
        dt, self._at = now - self._at, now
        keep = 0.5 ** (dt / self.half_life_s) if self.half_life_s > 0 else 1.0
        for key in list(self._used):
            self._used[key] *= keep
            if self._used[key] < FORGET_BELOW and not self._open[key]:
                del self._used[key]
        for key, nodes in self._held.items():
            self._used[key] = self._used.get(key, 0.0) + nodes * dt

    def change(self, old: JobRecord | None, new: JobRecord | None, now: float) -> None:
        """A job changed from `old` to `new` (None: unknown before, or deleted) at `now`."""
        self.accrue(now)
        self._count(new, 1)  # (before `old` is taken out: a job that stays unfinished never reopens its key)
        self._count(old, -1)

    def recount(self, jobs: Iterable[JobRecord], now: float) -> None:
        """What is held and open now is `jobs`' (the index reloaded them); the use so far is
        kept, and no key counts as opened again."""
        self.accrue(now)
        self._held.clear()
        self._open.clear()
        for job in jobs:
            self._count(job, 1, reopen=False)

    def used(self, now: float) -> dict[Key, float]:
        """(user, priority) -> node-seconds, decayed, up to `now`."""
        self.accrue(now)
        return dict(self._used)

    def held(self) -> Counter[Key]:
        """(user, priority) -> the nodes its jobs hold now."""
        return Counter(self._held)

    def _count(self, job: JobRecord | None, by: int, reopen: bool = True) -> None:
        if job is None or job.state.is_terminal():
            return
        key = (job.owner, job.spec.priority)
        if reopen and by > 0 and not self._open[key]:
            self._opened(key)
        self._open[key] += by
        if not self._open[key]:
            del self._open[key]
        if nodes := len(held_nodes(job)):
            self._held[key] += by * nodes
            if not self._held[key]:
                del self._held[key]

    def _opened(self, key: Key) -> None:
        """`key` has an unfinished job again: its use is at least the least of those that
        have one at its priority (no use banked while it had nothing to run)."""
        peers = [self._used.get(k, 0.0) for k in self._open if k[1] == key[1] and k != key]
        if peers:
            self._used[key] = max(self._used.get(key, 0.0), min(peers))
