"""A worker that first tries what a job run as another user must not do, then trains.

    run_as_probe.py AGENT_PID PATH ... -- TRAIN_ARGS

Rank 0 prints `probe uid=<uid>`, then `probe <path> <outcome>` for each PATH and for the
agent's /proc/<pid>/environ (outcome: READ, or the error's name), and `probe signal-agent
<outcome>` for a signal 0 sent to the agent; every rank then runs examples/train.py with
TRAIN_ARGS (snapshots through the runtime).
"""

import os
import runpy
import sys
from pathlib import Path

TRAIN = Path(__file__).resolve().parents[2] / "examples" / "train.py"


def probe(agent_pid: int, paths: list[str]) -> None:
    print(f"probe uid={os.getuid()}", flush=True)
    for p in [*paths, f"/proc/{agent_pid}/environ"]:
        try:
            if os.path.isdir(p):
                os.listdir(p)
            else:
                with open(p, "rb") as f:
                    f.read(1)
            got = "READ"
        except OSError as exc:
            got = type(exc).__name__
        print(f"probe {p} {got}", flush=True)
    try:
        os.kill(agent_pid, 0)
        got = "ALLOWED"
    except OSError as exc:
        got = type(exc).__name__
    print(f"probe signal-agent {got}", flush=True)


def main() -> None:
    sep = sys.argv.index("--")
    if os.environ.get("RANK", "0") == "0" and os.environ.get("FTRAIN_ATTEMPT") == "1":
        probe(int(sys.argv[1]), sys.argv[2:sep])
    sys.argv = [str(TRAIN), *sys.argv[sep + 1:]]
    runpy.run_path(str(TRAIN), run_name="__main__")


if __name__ == "__main__":
    main()
