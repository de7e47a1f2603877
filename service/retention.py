"""The retention loop: the leader deletes finished jobs past their retention.

Which jobs: `service.decide.retention.expired`, on the finished jobs the watch-fed index
knows (so no pass reads the whole history from etcd). Each pass then reads the chosen
records fresh (a page at a time), and for each job still finished deletes its logs
(`LogStore.delete`), its secret env file (`Keyring.delete_env`) and rendezvous keys, then
its record, events, snapshot records and idempotency key (which its record names; keys of
jobs deleted before records named them are swept once per lead), in transactions of at
most MAX_TXN_OPS operations, each fenced on the job's revision and on the leader's key
(`Leadership.fence`): a replica that lost the lead deletes nothing more. The record goes
last, so a pass cut short leaves a job that the next pass finds again, never logs without
a job.
"""

from __future__ import annotations

import asyncio
import logging

from service.decide.retention import RetentionPolicy, expired, pass_interval_s
from service.errors import StaleLeader, StoreUnavailable
from service.job_index import JobIndex
from service.jobs import JobStore
from service.keyring import Keyring
from service.logs import LogStore
from service.rendezvous import delete_rendezvous
from service.scheduler import Leadership

log = logging.getLogger(__name__)

# Jobs one pass deletes at most; a pass that reaches it is followed by another at once.
MAX_DELETIONS_PER_PASS = 256


async def prune(jobs: JobStore, logs: LogStore, index: JobIndex, fence: dict[str, int],
                policy: RetentionPolicy, keyring: Keyring | None = None) -> list[str]:
    """One pass: delete what has expired (at most MAX_DELETIONS_PER_PASS jobs); returns their ids."""
    chosen = expired(index.finished(), jobs.clock(), policy)[:MAX_DELETIONS_PER_PASS]
    if not chosen:
        return []
    reasons = {e.job_id: e.reason for e in chosen}
    doomed = [(job, revision) for job, revision in await jobs.get_many_with_revisions(list(reasons))
              if job.state.is_terminal()]
    for job, _ in doomed:
        if keyring is not None and job.secret_env_names:
            keyring.delete_env(job.token_nonce)
        await logs.delete(job.id)
        await delete_rendezvous(jobs.kv, jobs.keys, job.id)
    deleted = await jobs.delete_finished(doomed, fence)
    for job_id in deleted:
        log.debug("retention: deleted job %s (%s)", job_id, reasons[job_id])
    if deleted:
        log.info("retention: deleted %d finished job(s), the oldest %s (%s)", len(deleted),
                 deleted[0], reasons[deleted[0]])
    return deleted


async def run(jobs: JobStore, logs: LogStore, index: JobIndex, leadership: Leadership,
              policy: RetentionPolicy, keyring: Keyring | None = None) -> None:
    """Prune while this replica leads, every `pass_interval_s(policy)`. Runs until cancelled."""
    interval_s = pass_interval_s(policy)
    swept: dict[str, int] | None = None  # the lead under which orphaned keys were last swept
    while True:
        busy = False
        try:
            fence = leadership.fence()
            if fence is not None and index.ready.is_set():
                busy = len(await prune(jobs, logs, index, fence, policy, keyring)) >= MAX_DELETIONS_PER_PASS
                if fence != swept:  # once per lead: keys of jobs deleted before records named them
                    if n := await jobs.delete_orphaned_keys(fence):
                        log.info("retention: deleted %d idempotency key(s) of deleted jobs", n)
                    swept = fence
        except StaleLeader as exc:
            log.info("retention: %s", exc.message)
        except StoreUnavailable as exc:
            log.warning("retention paused: %s", exc.message)
        except Exception:
            log.exception("retention pass failed; retrying")
        await asyncio.sleep(0 if busy else interval_s)
