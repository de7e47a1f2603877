"""A runtime job that trains for --steps steps, reporting progress, then stops stepping:
it sleeps for ever, as a worker stuck in a collective or a data loader would (the job's
`hang_timeout_s` is what notices). Rank 0 prints `hanging at step=N attempt=A` when it stops.
With --hang-rank R only rank R stops: the others go on to the next step's collective and wait
there for it."""

import argparse
import os
import time

import torch

from ftrain import runtime
from worker.env import FTRAIN_ATTEMPT


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--step-time", type=float, default=0.2)
    ap.add_argument("--hang-rank", type=int, default=None, help="only this rank stops stepping")
    args = ap.parse_args()
    rt = runtime.init()
    model = rt.wrap(torch.nn.Linear(4, 1))
    rt.restore(model=model)
    while rt.step < args.steps or (args.hang_rank is not None and rt.rank != args.hang_rank):
        time.sleep(args.step_time)
        rt.step_done(loss=0.0)
    if rt.is_chief:
        print(f"hanging at step={rt.step} attempt={os.environ.get(FTRAIN_ATTEMPT)}", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main()
