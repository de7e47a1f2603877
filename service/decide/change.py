"""What a decision asks to have written."""

from __future__ import annotations

from dataclasses import dataclass, field

from service.models import EventView, JobRecord
from service.store.api import Op


@dataclass
class Change:
    """What a decide function wants written: the new record, its events, extra writes."""

    job: JobRecord
    events: list[EventView] = field(default_factory=list)
    ops: list[Op] = field(default_factory=list)
