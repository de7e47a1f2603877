"""The ftrain runtime with FSDP2: a small transformer, sharded with `fully_shard`.

Runs the same way as examples/train.py (the runtime picks what applies):

    python examples/train_fsdp.py --steps 50                    # local twin: one process
    torchrun --nproc-per-node=2 examples/train_fsdp.py          # plain torchrun (gloo or NCCL)
    ftrain submit job.json                                      # as an ftrain job

Each transformer block and the whole model are sharded with FSDP2's `fully_shard`, so
each rank holds only its shards of the parameters and of AdamW's state. The runtime sees
that and snapshots with torch.distributed.checkpoint: each rank writes its own shards, and
a job that comes back with another number of ranks reshards them on load.

The data are token sequences drawn from a fixed random Markov chain (from `--seed`):
nothing is downloaded and every run sees the same samples in the same order. Rank 0
prints `step=<n> loss=<x>`; at the end every rank takes part in gathering the full model,
and rank 0 saves it to `--out`: a run with failures must end with the same bytes.
"""

from __future__ import annotations

import argparse
import logging
import time

import torch
from torch import nn

from ftrain import runtime

try:  # torch >= 2.6 (2.4 and 2.5: torch.distributed._composable.fsdp)
    from torch.distributed.fsdp import fully_shard
except ImportError:  # pragma: no cover - older torch
    from torch.distributed._composable.fsdp import fully_shard


def synthetic_tokens(samples: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    """`samples` sequences of `length + 1` tokens from a random Markov chain fixed by `seed`."""
    g = torch.Generator().manual_seed(seed)
    transitions = torch.softmax(3.0 * torch.randn(vocab, vocab, generator=g), dim=1)
    tokens = torch.empty(samples, length + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(vocab, (samples,), generator=g)
    for t in range(length):
        tokens[:, t + 1] = torch.multinomial(transitions[tokens[:, t]], 1, generator=g).squeeze(1)
    return tokens


class TinyTransformer(nn.Module):
    """A causal transformer from torch.nn: embeddings, `depth` encoder blocks, a head."""

    def __init__(self, vocab: int, length: int, dim: int, heads: int, depth: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(length, dim)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, dim_feedforward=4 * dim, dropout=0.0, batch_first=True)
            for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(length), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.embed(tokens) + self.position(positions)
        for block in self.blocks:
            h = block(h, src_mask=self.causal, is_causal=True)
        return self.head(self.norm(h))


def shard(model: TinyTransformer, device: torch.device, replicas: int = 1) -> nn.Module:
    """Each block a unit of its own (its parameters gathered only while it runs), then the rest.
    With `replicas` > 1, HSDP: the ranks form `replicas` groups (consecutive ranks, a node's
    when each node runs world / replicas of them), each holding the whole model sharded
    among its ranks, and the groups replicate each other as DDP would."""
    model.to(device)
    mesh = None
    if replicas > 1:
        from torch.distributed.device_mesh import init_device_mesh

        world = torch.distributed.get_world_size()
        if world % replicas:
            raise SystemExit(f"--replicate {replicas} does not divide the {world} ranks")
        mesh = init_device_mesh(device.type, (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="optimizer steps in all")
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step, all ranks together")
    p.add_argument("--length", type=int, default=16, help="tokens per sequence")
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--depth", type=int, default=2, help="transformer blocks")
    p.add_argument("--samples", type=int, default=1024, help="size of the synthetic dataset")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replicate", type=int, default=1,
                   help="HSDP: this many replicas of the model, each sharded over world / N ranks")
    p.add_argument("--out", help="rank 0 saves the final (full) model state_dict here")
    p.add_argument("--seen", help="each rank appends the sample indices of its steps here (a test's count)")
    p.add_argument("--step-delay", type=float, default=0.0,
                   help="sleep this long per step (to watch it, or to give a test time to strike)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)

    torch.manual_seed(args.seed)  # the same initial weights on every rank, whatever the world size
    rt = runtime.init(total_steps=args.steps)
    data = synthetic_tokens(args.samples, args.length, args.vocab, args.seed)
    # Built where it trains: a billion parameters initialised on a GPU take milliseconds, on
    # one CPU thread seconds, and a restart pays them again.
    with torch.device(rt.device):
        net = TinyTransformer(args.vocab, args.length, args.dim, args.heads, args.depth)
    model = shard(net, rt.device, args.replicate) if rt.distributed else net.to(rt.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=50, gamma=0.5)
    # A global batch: the same samples per step whatever the number of ranks.
    sampler = rt.sampler(args.samples, global_batch_size=args.global_batch, seed=args.seed)
    start = rt.restore(model=model, optimizer=optimizer, scheduler=scheduler, sampler=sampler)
    if rt.is_chief:
        print(f"start step={start} world={rt.world_size}", flush=True)

    for indices in sampler:
        if rt.step >= args.steps:
            break
        batch = data[indices].to(rt.device)
        logits = model(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, args.vocab), batch[:, 1:].reshape(-1))
        loss = loss * sampler.loss_weight
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        if args.seen:
            with open(f"{args.seen}.{rt.rank}", "a") as f:
                f.write(f"{rt.step + 1} {' '.join(map(str, indices))}\n")
        rt.log(lr=scheduler.get_last_lr()[0])
        rt.step_done(loss=loss, samples=sampler.global_batch_size)
        if rt.is_chief:
            print(f"step={rt.step} loss={loss.item():.6f}", flush=True)
        if args.step_delay:
            time.sleep(args.step_delay)

    full = runtime.full_model_state(model)  # a collective: every rank takes part
    rt.finish()
    if rt.is_chief and args.out:
        torch.save(full, args.out)
        print(f"saved {args.out}", flush=True)


if __name__ == "__main__":
    main()
