"""The one way a control plane keeps a view of an etcd prefix: load it, then follow its watch.

Used by the job index (`service.job_index`) and the users' teams and quotas
(`service.tenancy`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from service.errors import HistoryCompacted, StoreUnavailable
from service.store.api import KeyValue, WatchEvent

log = logging.getLogger(__name__)


async def follow_prefix(kv: KeyValue, prefix: str, load: Callable[[], Awaitable[int]],
                       apply: Callable[[WatchEvent, str], None], ready: asyncio.Event, what: str,
                       notify: Callable[[], Awaitable[None]] | None = None) -> None:
    """A watch loop that keeps a view of the keys under `prefix`: `load` them (it
    returns the revision read before the load), set `ready`, then `apply` each watch
    event (with the key past `prefix`), `notify` after the load and after each event.

    A watch is started from the revision of the last event applied, not after it: a
    watch stream that ended between two events of one transaction must not lose the second
    (applying one twice is harmless). A watch stream that ends quietly watches on from there;
    a compacted history loads again at once; a broken watch (etcd away) clears `ready`
    and loads again half a second later.
    """
    revision: int | None = None  # every change up to it is applied
    while True:
        try:
            if revision is None:
                revision = await load()
                ready.set()
                if notify is not None:
                    await notify()
            async for ev in kv.watch_prefix(prefix, revision):
                apply(ev, ev.key[len(prefix):])
                revision = ev.mod_revision
                if notify is not None:
                    await notify()
            continue  # the watch stream ended quietly: watch on from where it was
        except HistoryCompacted as exc:  # not an outage: load again at once
            log.debug("%s: %s", what, exc.message)
            revision = None
            continue
        except StoreUnavailable as exc:
            log.debug("%s: %s", what, exc.message)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s: watch failed; re-reading", what)
        revision = None
        ready.clear()
        await asyncio.sleep(0.5)
