"""A group's output files as torchrun lays them out, and the agent's reading of them, for the
unit tests of worker/torchrun.py and worker/output.py: torchrun's own stdout and stderr, and
each worker's `<log dir>/<run id>_<random>/attempt_<restart>/<local rank>/stdout.log|stderr.log`
with the note its launcher leaves (worker/launch.py `leave_note`)."""

from __future__ import annotations

from pathlib import Path

from worker.launch import leave_note
from worker.output import WorkerDirs
from worker.protocol import LogLineIn
from worker.torchrun import Torchrun, WorkerGroup

RUN = "j-a2"


class Shipper:
    def __init__(self):
        self.lines: list[LogLineIn] = []

    def add(self, job_id: str, attempt: int, line: LogLineIn, *, wait_for_room: bool = False) -> None:
        self.lines.append(line)


class Exited:
    returncode = 1

    def poll(self) -> int:
        return 1


def worker_dir(log_dir: Path, restart: int, local_rank: int, rank: int | None = None,
               round_: int | None = None) -> Path:
    """A worker's folder, made as torchrun makes it, with its launcher's note (none when
    `rank` is None: a launcher that could not write it)."""
    folder = log_dir / f"{RUN}_abc123" / f"attempt_{restart}" / str(local_rank)
    folder.mkdir(parents=True, exist_ok=True)
    if rank is not None:
        env = {"TORCHELASTIC_ERROR_FILE": str(folder / "error.json"), "RANK": str(rank)}
        leave_note(env | ({} if round_ is None else {"FTRAIN_ROUND": str(round_)}))
    return folder


def write_worker(log_dir: Path, restart: int, local_rank: int, lines: list[str], rank: int | None = None,
                 round_: int | None = None, stream: str = "stdout") -> Path:
    folder = worker_dir(log_dir, restart, local_rank, rank, round_)
    for s in ("stdout", "stderr"):
        (folder / f"{s}.log").touch()
    path = folder / f"{stream}.log"
    with open(path, "a") as f:
        f.write("".join(x + "\n" for x in lines))
    return path


def follow(tmp_path: Path, g: WorkerGroup, torchrun_lines: dict[str, str] | None = None,
           shipper: Shipper | None = None, server: str = "http://cp") -> list[LogLineIn]:
    """What the agent ships of the output in `tmp_path` ("logs": the workers' files;
    `torchrun_lines`: torchrun's own, by stream) for a group `g` whose torchrun has exited."""
    shipper = shipper or Shipper()
    outputs = {}
    for stream, text in (torchrun_lines or {}).items():
        outputs[stream] = tmp_path / f"n1-attempt{g.attempt}.{stream}"
        outputs[stream].write_text(text)
    g.outputs = outputs
    t = Torchrun("n1", server, tmp_path, None, shipper)
    t.follow(g, WorkerDirs(tmp_path / "logs", RUN))
    for th in g.threads:
        th.join(10)
    assert not any(th.is_alive() for th in g.threads)
    t._release_held(g)
    return shipper.lines
