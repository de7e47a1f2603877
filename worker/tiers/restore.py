"""Where a restart resumes from: rank 0's choice among the tiers, which it then broadcasts."""

from __future__ import annotations

import logging

from ..links import Link
from .disk import DiskTier
from .peer import PeerTier

log = logging.getLogger("ftrain.runtime")


def choose(link: Link | None, disk: DiskTier | None, peer: PeerTier) -> tuple | None:
    """Rank 0, once every rank's memory copy is gathered (`PeerTier.gather`): ("memory", step,
    source rank) when the control plane's restore point (service/decide/restore.py) is a
    memory copy some rank holds, else ("disk", step, path) of the newest good committed
    snapshot, or None. Without a link (no control plane, no snapshot folder): the newest memory copy."""
    if disk is not None:
        disk.await_handed_over()
    newest = peer.newest()
    if newest is not None and link is None:
        return ("memory", newest.step, newest.where)
    if newest is not None and link is not None:
        point = link.restore_point(newest.step)
        log.info("restore point: %s", point.reason)
        held = peer.holds(point.step) if point.tier == "memory" else None
        if held is not None:
            return ("memory", held.step, held.where)
        if point.tier == "memory":
            log.warning("restore point: step %s is held by no rank of this group; trying disk", point.step)
    found = disk.newest() if disk is not None else None
    return None if found is None else ("disk", found.step, found.where)
