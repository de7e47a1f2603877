"""`ftrain status --watch` on a terminal: a progress bar (rich) redrawn in place until the job
ends: state, bar, percent, then the line's step, ETA, loss, speed and nodes. Off a terminal
(a pipe, a file, `--json`) the CLI prints plain lines instead (`service.cli._watch`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection


def watch_with_bar(get_job: Callable[[], dict], interval_s: float,
                   describe: Callable[[dict, float], str], done_states: Collection[str],
                   console=None, sleep: Callable[[float], None] = time.sleep,
                   now: Callable[[], float] = time.time) -> dict:
    """Redraw the bar from `get_job()` every `interval_s` until the job is in one of
    `done_states`; returns that last view. No total (the script did not give one): the bar
    pulses and no percent is shown."""
    from rich.console import Console  # imported here: the rest of the CLI does without it
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn

    columns = (TextColumn("{task.fields[state]:<10}"), BarColumn(bar_width=30), TaskProgressColumn(),
               TextColumn("{task.fields[info]}"))
    with Progress(*columns, console=console or Console(), auto_refresh=False) as bar:
        task = bar.add_task("job", total=None, state="", info="")
        while True:
            job = get_job()
            progress = job.get("progress") or {}
            bar.update(task, total=progress.get("total_steps") or None,
                       completed=progress.get("step") or 0, state=job["state"],
                       info=describe(job, now()))
            bar.refresh()
            if job["state"] in done_states:
                return job
            sleep(interval_s)
