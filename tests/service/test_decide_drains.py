"""When a stored drain is swept (service/decide/drains.py): a table."""

from __future__ import annotations

import pytest

from service.decide.drains import DrainAction, StoredDrain, sweep

KEEP = 100.0


@pytest.mark.parametrize("drain, live, now, expected", [
    (StoredDrain("a", 1.0), {"a"}, 500.0, None),  # registered: kept as it is
    (StoredDrain("a", 1.0, absent_since=400.0), {"a"}, 500.0, "clear_absent"),  # back: note cleared
    (StoredDrain("a", 1.0), set(), 500.0, "note_absent"),  # first seen absent
    (StoredDrain("a", 1.0, absent_since=450.0), set(), 500.0, None),  # absent, not long enough
    (StoredDrain("a", 1.0, absent_since=400.0), set(), 500.0, "delete"),  # absent for the keep
    (StoredDrain("a", 1.0, absent_since=400.0), {"b"}, 499.9, None),  # another node is not it
])
def test_sweep(drain, live, now, expected):
    actions = sweep([drain], live, now, KEEP)
    assert actions == ([DrainAction("a", expected)] if expected else [])
