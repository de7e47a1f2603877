"""The ftrain runtime example: a small MLP regressing a synthetic, seeded dataset.

Runs the same way in all three settings (the runtime picks what applies):

    python examples/train.py --steps 50                    # local twin: one process, no service
    torchrun --nproc-per-node=2 examples/train.py          # plain torchrun
    ftrain submit examples/job.json                        # as an ftrain job

The data are generated from `--seed`, so nothing is downloaded and every run sees the
same samples in the same order. Rank 0 prints `step=<n> loss=<x>` and, at the end,
saves the final weights to `--out`: a run with failures must end with the same bytes.
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

from ftrain import runtime


def synthetic_dataset(samples: int, features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed regression problem: y = tanh(x @ w) @ v + noise, all from `seed`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=g)
    w = torch.randn(features, 32, generator=g) / features ** 0.5
    v = torch.randn(32, 1, generator=g)
    y = torch.tanh(x @ w) @ v + 0.05 * torch.randn(samples, 1, generator=g)
    return x, y


def build_model(features: int, width: int, depth: int) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    size = features
    for _ in range(depth):
        layers += [torch.nn.Linear(size, width), torch.nn.ReLU()]
        size = width
    layers.append(torch.nn.Linear(size, 1))
    return torch.nn.Sequential(*layers)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="optimizer steps in all")
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--width", type=int, default=64, help="hidden units per layer")
    p.add_argument("--depth", type=int, default=2, help="hidden layers")
    p.add_argument("--features", type=int, default=16)
    p.add_argument("--samples", type=int, default=2048, help="size of the synthetic dataset")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="rank 0 saves the final model state_dict here")
    p.add_argument("--step-delay", type=float, default=0.0,
                   help="sleep this long per step (to watch it, or to give a test time to strike)")
    p.add_argument("--slow-rank", type=int, default=None,
                   help="this rank sleeps --slow-by times --step-delay per step: a straggler to see flagged")
    p.add_argument("--slow-node", default=None,
                   help="the ranks on this node (its name) sleep --slow-by times --step-delay per step")
    p.add_argument("--slow-by", type=float, default=1.5)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a log line per control poll

    torch.manual_seed(args.seed)
    rt = runtime.init(total_steps=args.steps)  # the dashboard's percent and time left
    x, y = synthetic_dataset(args.samples, args.features, args.seed)
    model = rt.wrap(build_model(args.features, args.width, args.depth))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=50, gamma=0.5)
    sampler = rt.sampler(args.samples, batch_size=args.batch, seed=args.seed)
    start = rt.restore(model=model, optimizer=optimizer, scheduler=scheduler, sampler=sampler)
    if rt.is_chief:
        print(f"start step={start} world={rt.world_size}", flush=True)

    for indices in sampler:
        if rt.step >= args.steps:
            break
        xb, yb = x[indices].to(rt.device), y[indices].to(rt.device)
        loss = torch.nn.functional.mse_loss(model(xb), yb) * sampler.loss_weight
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        rt.log(lr=scheduler.get_last_lr()[0])
        rt.step_done(loss=loss, samples=sampler.global_batch_size)
        if rt.is_chief:
            print(f"step={rt.step} loss={loss.item():.6f}", flush=True)
        if args.step_delay:
            slow = rt.rank == args.slow_rank or (args.slow_node is not None and rt.node == args.slow_node)
            time.sleep(args.step_delay * (args.slow_by if slow else 1.0))

    rt.finish()
    if rt.is_chief and args.out:
        torch.save(runtime._unwrap(model).state_dict(), args.out)
        print(f"saved {args.out}", flush=True)


if __name__ == "__main__":
    main()
