"""`ftrain status --watch` on a terminal: the rich progress bar (service/progress_view.py)."""

from __future__ import annotations

import io

from rich.console import Console

from service.cli import EXIT_CODES, _progress_details
from service.progress_view import watch_with_bar


def watched(views: list[dict]) -> tuple[str, dict]:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120, color_system=None)
    seen = list(views)
    job = watch_with_bar(lambda: seen.pop(0) if len(seen) > 1 else seen[0], 0.0, _progress_details,
                         EXIT_CODES, console=console, sleep=lambda s: None, now=lambda: 1e12)
    return out.getvalue(), job


def view(state: str, **progress) -> dict:
    return {"id": "j1", "state": state, "reason": "", "nodes": ["n0", "n1"], "progress": progress}


def test_the_bar_shows_percent_eta_and_the_line_until_the_job_ends():
    text, job = watched([view("RUNNING", step=100, total_steps=400, eta_s=125.0, time=1e12, loss=0.5),
                         view("SUCCEEDED", step=400, total_steps=400, time=1e12)])
    assert job["state"] == "SUCCEEDED"
    assert "━" in text  # the bar
    assert "25%" in text and "ETA 2m05s" in text and "loss 0.5" in text and "nodes 2" in text
    assert "100%" in text and "SUCCEEDED" in text
    assert "\x1b[" in text  # redrawn in place on a terminal


def test_without_a_total_the_bar_shows_no_percent():
    text, _ = watched([view("FAILED", step=7, loss=1.0)])
    assert "step 7" in text and "%" not in text
