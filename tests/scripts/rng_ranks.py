"""Two ranks of one node (gloo) train with the memory tier on, each drawing from its own RNG
every step, then write their RNG state (the torch generator's bytes) after `--steps` to
`<out>.<rank>`. Run again on the same memory directory it resumes from memory.
(tests/worker/test_memory_rng.py)"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from ftrain import runtime  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--memory", required=True)
p.add_argument("--steps", type=int, required=True)
p.add_argument("--out", required=True)
p.add_argument("--every", type=int, default=1, help="a memory copy every N steps")
args = p.parse_args()

rt = runtime.init(memory_dir=args.memory, memory_every=args.every)
torch.manual_seed(1000 + rt.rank)  # each rank its own stream (a fresh start draws from here)
model = rt.wrap(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
start = rt.restore(model, opt)
print(f"rank {rt.rank} start step={start} tier={rt.resumed_tier}", flush=True)
while rt.step < args.steps:
    x = torch.rand(4, 8)  # this rank's RNG moves every step
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
    rt.step_done()
Path(f"{args.out}.{rt.rank}").write_bytes(torch.get_rng_state().numpy().tobytes())
rt.finish()
