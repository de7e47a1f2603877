"""A small DDP job for the integration tests, in the style of PyTorch's DDP tutorial.

It trains a tiny model on gloo, one step every --step-time seconds, rank 0 saving a
tutorial-style `snapshot.pt` (model, optimizer, step) into FTRAIN_SNAPSHOT_DIR every
--snapshot-every steps; every rank loads it on start. Rank 0 prints one line per step:
`step=<n> world=<w> attempt=<a>` so tests can follow progress in the job's logs.
"""

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--step-time", type=float, default=0.1)
    ap.add_argument("--snapshot-every", type=int, default=5)
    ap.add_argument("--fail", action="store_true", help="exit 3 after the first step")
    ap.add_argument("--crash-on-exit", action="store_true",
                    help="finish well, then abort while the interpreter tears down")
    ap.add_argument("--finish-late", type=float, default=0.0, metavar="S",
                    help="rank 0 returns S seconds after the others (a final save, say)")
    args = ap.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    path = os.path.join(os.environ.get("FTRAIN_SNAPSHOT_DIR", "."), "snapshot.pt")
    step = 0
    if os.path.exists(path):
        snap = torch.load(path, weights_only=True)
        model.module.load_state_dict(snap["model"])
        opt.load_state_dict(snap["optimizer"])
        step = snap["step"]
        if rank == 0:
            print(f"resumed step={step}", flush=True)
    while step < args.steps:
        x = torch.randn(8, 16)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if rank == 0:
            print(f"step={step} world={world} attempt={os.environ.get('FTRAIN_ATTEMPT')}", flush=True)
            if step % args.snapshot_every == 0:
                tmp = path + ".tmp"
                torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                            "step": step}, tmp)
                os.replace(tmp, path)
        if args.fail:
            print("failing on purpose", file=sys.stderr, flush=True)
            return 3
        time.sleep(args.step_time)
    dist.destroy_process_group()
    if rank == 0 and args.finish_late:
        time.sleep(args.finish_late)
    if args.crash_on_exit:
        global crash_on_teardown
        crash_on_teardown = CrashOnTeardown()  # released when the module is torn down
    return 0


class CrashOnTeardown:
    """What torch's backend threads do now and then at exit (see worker/fork_server.py), on cue."""

    def __del__(self, abort=os.abort):  # bound now: teardown may have cleared `os` by then
        abort()


if __name__ == "__main__":
    sys.exit(main())
