"""What one memory-tier capture costs the training thread, apart from training: the
memory tier's `save` (worker/tiers/memory.py) (a `StatePlan`'s state, the writer's `capture_split`) timed
alone, the copy waited for (untimed) between captures, with the side stream's work
replayed from CUDA graphs and enqueued call by call; and the single calls a capture is
made of, for scale (a host's Python speed decides these figures, not its GPU).

    python bench/capture_cost.py [--width 1536] [--repeats 200]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.snapshot import build  # noqa: E402
from worker import memory as mem  # noqa: E402
from worker import rng, runtime  # noqa: E402


def median_us(fn, repeats: int, between=None) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        if between is not None:
            between()
    return statistics.median(times) * 1e6


def captures(width: int, repeats: int, graphs: bool, directory: Path, profile: bool = False) -> dict:
    mem.MemoryWriter.graphs = graphs
    rt = runtime.init(env={}, memory_dir=directory, memory_every=1)
    torch.manual_seed(0)
    model = rt.wrap(build(width, rt.device))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rt.restore(model=model, optimizer=opt)
    x = torch.randn(32, width, device=rt.device)
    for _ in range(3):
        model(x).pow(2).mean().backward()
        opt.step()
        rt.step_done()
        rt.memory.writer.wait(stall=False)
    w = rt.memory.writer
    rng_now = rng.rng_state()
    prof = cProfile.Profile() if profile else None

    def commit() -> None:  # the copy made whole and committed (on this thread, the GPU path's way)
        if prof is not None:
            prof.enable()
        w.wait(stall=False)
        if prof is not None:
            prof.disable()

    out = {"rng_state_us": median_us(rng.rng_state, repeats),
           "copy_to_memory_us": median_us(lambda: rt.memory.save(rt._state, rt.step, rng_now), repeats, between=commit),
           "commit_ms": statistics.median(w.commits_s[-repeats:] or [0.0]) * 1e3,
           "commit_cpu_ms": statistics.median(w.commits_cpu_s[-repeats:] or [0.0]) * 1e3,
           "graphed": w.graphed, "tensors": len(rt.memory.plan.tensors) if rt.memory.plan else None}
    rt.finish()
    mem.MemoryWriter.graphs = True
    if prof is not None:
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
        out["commit_profile"] = "\n" + text.getvalue()
    return out


def calls(repeats: int) -> dict:
    dev = torch.device("cuda")
    side = torch.cuda.Stream(dev)
    ev = torch.cuda.Event()
    small = [torch.zeros((), device=dev) for _ in range(24)]
    dst = [torch.zeros((), device=dev) for _ in range(24)]
    cpu = [torch.zeros(()) for _ in range(8)]
    cpu_dst = [torch.zeros(()) for _ in range(8)]
    host = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
    dev_buf = torch.empty(1 << 20, dtype=torch.uint8, device=dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.Stream(dev)):
        torch._foreach_copy_(dst, small)
    torch.cuda.synchronize()

    def in_side():
        with torch.cuda.stream(side):
            pass

    out = {"current_stream_us": median_us(lambda: torch.cuda.current_stream(dev), repeats),
           "event_record_us": median_us(lambda: ev.record(torch.cuda.current_stream(dev)), repeats),
           "wait_event_us": median_us(lambda: side.wait_event(ev), repeats),
           "stream_context_us": median_us(in_side, repeats),
           "foreach_copy_24_gpu_us": median_us(lambda: torch._foreach_copy_(dst, small), repeats),
           "foreach_copy_8_cpu_us": median_us(lambda: torch._foreach_copy_(cpu_dst, cpu), repeats),
           "copy_d2h_1mb_nonblocking_us": median_us(lambda: host.copy_(dev_buf, non_blocking=True), repeats),
           "graph_replay_us": median_us(graph.replay, repeats)}
    torch.cuda.synchronize()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=1536)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--profile-commit", action="store_true",
                   help="cProfile the commits of the copies with graphs (where a commit's time goes)")
    args = p.parse_args()
    base = mem.SHM_ROOT if mem.SHM_ROOT.is_dir() else None
    results = {}
    for graphs in ((True, False) if torch.cuda.is_available() else (False,)):
        with tempfile.TemporaryDirectory(prefix="ftrain-capture-", dir=base) as d:
            name = "graphs" if graphs else "call_by_call"
            profile = args.profile_commit and (graphs or not torch.cuda.is_available())
            results[name] = captures(args.width, args.repeats, graphs, Path(d), profile)
    if torch.cuda.is_available():
        results["calls"] = calls(args.repeats)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"capture cost on the training thread, {device}, torch {torch.__version__}, width {args.width}, "
          f"median of {args.repeats}")
    for name, got in results.items():
        for key, value in got.items():
            print(f"  {name:>12}  {key:<30} {value:.1f}" if isinstance(value, float)
                  else f"  {name:>12}  {key:<30} {value}")


if __name__ == "__main__":
    main()
