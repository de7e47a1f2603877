"""The retention loop: the leader deletes finished jobs past their retention.

Which jobs: `service.decide.retention.expired`, on the finished jobs the watch-fed index
knows (so no pass reads the whole history from etcd). Each pass then reads the chosen
records fresh (a page at a time), and for each job still finished deletes its rendezvous
keys, then its record, events, snapshot records and idempotency key (which its record names;
keys of jobs deleted before records named them are swept once per lead), in transactions of
at most MAX_TXN_OPS operations, each fenced on the leader's key (`Leadership.fence`; the
record's also on the job's revision): a replica that lost the lead deletes nothing more. The
same transaction adds the deleted jobs' goodput to the cluster's totals (service.goodput).

Files go after the record: the job's log folder, its secret env file (`Keyring.delete_env`)
and, when the control plane has a snapshot root (`--snapshot-root`; `ftrain up` sets one),
its snapshot folder. In that order a reader never sees a job whose log is gone: `GET /logs`
checks the job after it read the files, so a read that raced the deletion answers 404,
never an empty log of a job that still exists (the soak's "empty logs"). A pass cut short
between the record and the files, or a shipment that arrived while its job was being
deleted, leaves a folder without a job: `sweep_orphans` deletes those, when a replica takes
the lead and every ORPHAN_SWEEP_S after (secret env files are named by a nonce, not a job,
and are not swept). Snapshot files kept on a node's own disk (no snapshot root) are out of
the control plane's
reach and stay there.

Drains: a drain is stored under the node's name, apart from its lease-bound record, so it
outlives the node; the loop sweeps the drains of nodes absent for `FTRAIN_DRAIN_KEEP_S`
(7 days by default) every DRAIN_SWEEP_S (`service.decide.drains` says how).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from pathlib import Path

from service.decide.retention import RetentionPolicy, expired, pass_interval_s
from service.decide.goodput import ledger
from service.errors import StaleLeader, StoreUnavailable
from service.goodput import events_of, retire
from service.job_index import JobIndex
from service.jobs import JobStore, looks_like_job_id
from service.keyring import Keyring
from service.logs import LogStore
from service.nodes import NodeStore
from service.rendezvous import delete_rendezvous
from service.scheduler import Leadership

log = logging.getLogger(__name__)

# Jobs one pass deletes at most; a pass that reaches it is followed by another at once.
MAX_DELETIONS_PER_PASS = 256
# How often the leader looks for folders (logs, snapshots) of jobs that no longer exist.
ORPHAN_SWEEP_S = 600.0
# How often the leader looks at the stored drains (`NodeStore.sweep_drains`).
DRAIN_SWEEP_S = 60.0


async def prune(jobs: JobStore, logs: LogStore, index: JobIndex, fence: dict[str, int],
                policy: RetentionPolicy, snapshot_root: str | Path | None = None,
                keyring: Keyring | None = None) -> list[str]:
    """One pass: delete what has expired (at most MAX_DELETIONS_PER_PASS jobs); returns their ids."""
    chosen = expired(index.finished(), jobs.clock(), policy)[:MAX_DELETIONS_PER_PASS]
    if not chosen:
        return []
    reasons = {e.job_id: e.reason for e in chosen}
    doomed = [(job, revision) for job, revision in await jobs.get_many_with_revisions(list(reasons))
              if job.state.is_terminal()]
    # Their goodput, added to the deleted jobs' totals as they go (service.goodput).
    ledgers = {job.id: ledger(job, await events_of(jobs, job.id), jobs.clock()) for job, _ in doomed}
    for job, _ in doomed:
        await delete_rendezvous(jobs.kv, jobs.keys, job.id, fence)
    deleted = await jobs.delete_finished(doomed, fence, retire(jobs, ledgers))
    nonces = {job.id: job.token_nonce for job, _ in doomed if job.secret_env_names}
    for job_id in deleted:  # after the record (the module's docstring says why)
        await delete_files(logs, snapshot_root, job_id)
        if keyring is not None and job_id in nonces:
            keyring.delete_env(nonces[job_id])
    for job_id in deleted:
        log.debug("retention: deleted job %s (%s)", job_id, reasons[job_id])
    if deleted:
        log.info("retention: deleted %d finished job(s), the oldest %s (%s)", len(deleted),
                 deleted[0], reasons[deleted[0]])
    return deleted


async def delete_files(logs: LogStore, snapshot_root: str | Path | None, job_id: str) -> None:
    """Delete a deleted job's log folder and its snapshot folder (if there is a snapshot root)."""
    await logs.delete(job_id)
    if snapshot_root is not None:
        folder = Path(snapshot_root) / job_id
        if job_id and "/" not in job_id and job_id not in (".", ".."):
            await asyncio.to_thread(shutil.rmtree, folder, True)


def _folders(root: str | Path | None) -> set[str]:
    """The folders under `root` named like a job (a shared snapshot root may hold others)."""
    try:
        return {e.name for e in os.scandir(root) if e.is_dir() and looks_like_job_id(e.name)} \
            if root is not None else set()
    except FileNotFoundError:
        return set()


async def sweep_orphans(jobs: JobStore, logs: LogStore, snapshot_root: str | Path | None) -> list[str]:
    """Delete the log and snapshot folders whose job no longer exists; returns their job ids.

    A folder is made only for a job that exists (a shipment or a snapshot of it), so a
    folder without a record is one retention deleted (or is deleting: its files go anyway).
    """
    names = await asyncio.to_thread(lambda: _folders(logs.root) | _folders(snapshot_root))
    if not names:
        return []
    ordered = sorted(names)
    alive = {job.id for job in await jobs.get_many(ordered)}
    gone = [name for name in ordered if name not in alive]
    for job_id in gone:
        await delete_files(logs, snapshot_root, job_id)
    return gone


async def run(jobs: JobStore, logs: LogStore, index: JobIndex, leadership: Leadership,
              policy: RetentionPolicy, snapshot_root: str | Path | None = None,
              keyring: Keyring | None = None, drains: tuple[NodeStore, float] | None = None) -> None:
    """Prune while this replica leads, every `pass_interval_s(policy)`; with `drains` (the
    node store, the keep in seconds), sweep the stored drains of nodes gone for good once every
    DRAIN_SWEEP_S (`service.decide.drains`). Runs until cancelled."""
    interval_s = pass_interval_s(policy)
    drains_swept_at = 0.0  # when stored drains were last swept (monotonic)
    swept: dict[str, int] | None = None  # the lead under which orphaned keys were last swept
    files_swept_at = 0.0  # when folders of deleted jobs were last swept (monotonic)
    while True:
        busy = False
        try:
            fence = leadership.fence()
            if fence is not None and index.ready.is_set():
                busy = len(await prune(jobs, logs, index, fence, policy, snapshot_root, keyring)) \
                    >= MAX_DELETIONS_PER_PASS
                if fence != swept:  # once per lead: keys of jobs deleted before records named them
                    if n := await jobs.delete_orphaned_keys(fence):
                        log.info("retention: deleted %d idempotency key(s) of deleted jobs", n)
                    files_swept_at = 0.0
                    swept = fence
                if time.monotonic() - files_swept_at >= ORPHAN_SWEEP_S:
                    if gone := await sweep_orphans(jobs, logs, snapshot_root):
                        log.info("retention: deleted the folders of %d deleted job(s)", len(gone))
                    files_swept_at = time.monotonic()
                if drains is not None and time.monotonic() - drains_swept_at >= DRAIN_SWEEP_S:
                    if gone := await drains[0].sweep_drains(fence, drains[1]):
                        log.info("retention: deleted the drains of %d node(s) absent for %.0f s or "
                                 "more: %s", len(gone), drains[1], ", ".join(gone))
                    drains_swept_at = time.monotonic()
        except StaleLeader as exc:
            log.info("retention: %s", exc.message)
        except StoreUnavailable as exc:
            log.warning("retention paused: %s", exc.message)
        except Exception:
            log.exception("retention pass failed; retrying")
        await asyncio.sleep(0 if busy else interval_s)
