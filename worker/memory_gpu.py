"""The memory tier's GPU path (worker/memory.py's module docstring, "On a GPU"): a staging
buffer on the device the state is copied into on a side stream, the checksum's sums taken
there, and one non-blocking copy of it into the slot (registered with CUDA, else through a
pinned buffer), replayed from CUDA graphs once the layout repeats. A `MemoryWriter`'s part."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from . import memory as mem

if TYPE_CHECKING:
    from .memory import MemoryWriter

log = logging.getLogger("ftrain.memory")


class GpuStaging:
    """The staging buffer, its events and CUDA graphs, and the pinned bounce buffer of one
    writer's GPU path."""

    def __init__(self, writer: MemoryWriter):
        self.writer = writer
        self.staging: tuple | None = None  # (packing, GPU bytes, their blocks, the checksum's sums)
        self.events: tuple = ()  # (boundary, staged, done), made with the staging buffer
        self.graphs: dict = {}  # for one layout: "layout", "stage" -> graph, slot -> graph
        self.bounce: torch.Tensor | None = None  # pinned host buffer where registration is refused
        self.graphed = 0  # copies whose side-stream work was replayed from graphs
        self.pinned: dict[int, bool] = {}  # slot -> its mapping is registered with CUDA

    def register(self, slot: int, buf: torch.Tensor) -> bool:
        """Page-lock the slot's mapping for CUDA (once per mapping), so that a non-blocking
        copy from the GPU lands in it directly; False where CUDA refuses."""
        if slot not in self.pinned:
            began = time.perf_counter()
            ok = False
            if self.writer.register_host:
                got: list = []

                def register() -> None:
                    try:  # 1: cudaHostRegisterPortable, as torch.distributed.checkpoint's stager does
                        got.append(int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 1)))
                    except (RuntimeError, AttributeError) as exc:
                        log.info("memory tier: cannot register the slot with CUDA (%s)", exc)

                # In a thread of its own: CUDA keeps a refused call's error per thread, and the
                # training thread's next kernel launch would raise it.
                t = threading.Thread(target=register, name="memory-register")
                t.start()
                t.join()
                ok = got == [0]
                if not ok:
                    log.info("memory tier: CUDA refused to register the slot; copying through a "
                             "pinned buffer")
            self.pinned[slot] = ok
            self.writer.host_copy = "registered" if ok else "pinned"
            self.writer._setup_s += time.perf_counter() - began
        return self.pinned[slot]

    def forget(self, slot: int) -> None:
        """The slot is unmapped: its graph copies to an old address."""
        self.graphs.pop(slot, None)

    def close(self) -> None:
        self.staging = None
        self.graphs = {}
        self.bounce = None

    def capture(self, lay: mem._Layout, buf: torch.Tensor, slot: int, views: list) -> tuple[list, Any]:
        """The GPU path (module docstring): enqueue the copies, return the thread's work. With
        the layout kept, this is a fixed handful of calls whatever the number of tensors: one
        batched copy of the CPU tensors into the slot, one of the buffers into the staging
        buffer on the training stream, one of the parameters and optimizer state on the side
        stream, one copy to the host; three events, made once."""
        device = lay.device
        w = self.writer
        if w._stream is None:
            w._stream = torch.cuda.Stream(device)
        if self.staging is None or self.staging[0] is not lay.packing:
            began = time.perf_counter()
            self.staging = None
            n = lay.end - lay.start
            block = 8 * mem.SUM_BLOCK
            padded = torch.zeros((n + block - 1) // block * block, dtype=torch.uint8, device=device)
            blocks = padded.view(torch.int64).view(-1, mem.SUM_BLOCK)  # zeros past n add nothing to sum64
            sums = (torch.empty(2, dtype=torch.int64, pin_memory=True),
                    torch.arange(blocks.shape[0], dtype=torch.int64, device=device),
                    torch.arange(1, mem.SUM_BLOCK + 1, dtype=torch.int64, device=device))
            self.staging = (lay.packing, padded[:n], blocks, sums)
            self.events = (torch.cuda.Event(), torch.cuda.Event(), torch.cuda.Event())
            self.graphs = {}
            w._setup_s += time.perf_counter() - began
        _, staging, blocks, sums = self.staging
        now_dst, late_dst = lay.staged_views(staging)
        if lay.cpu:
            torch._foreach_copy_(lay.cpu_views(slot, views), lay.cpu_src)
        boundary, staged, done = self.events
        training = torch.cuda.current_stream(device)
        if lay.now_src:
            torch._foreach_copy_(now_dst, lay.now_src)  # on the training stream: a forward may change them
        boundary.record(training)
        side = w._stream
        side.wait_event(boundary)
        deferred: list = []
        host = lay.host_range(slot, buf)
        registered = self.register(slot, buf)

        def stage() -> None:
            if lay.late_src:
                torch._foreach_copy_(late_dst, lay.late_src)

        def send() -> None:
            sums[0].copy_(mem._sum64_pair(blocks, sums[1], sums[2]), non_blocking=True)  # the checksum's GPU part
            host.copy_(staging, non_blocking=True)

        graphs = None
        if self.graphs.get("layout") is not lay:  # graphs copy fixed addresses: this layout's
            self.graphs = {"layout": lay}
        if w.graphs and registered and lay.repeated:
            graphs = self.graph("stage", stage, device), self.graph(slot, send, device)
            if None in graphs:
                graphs = None
        with torch.cuda.stream(side):
            if graphs is not None:
                graphs[0].replay()
                staged.record(side)
                graphs[1].replay()
                self.graphed += 1
            elif registered:
                stage()
                staged.record(side)
                send()
            else:
                stage()
                staged.record(side)
                sums[0].copy_(mem._sum64_pair(blocks, sums[1], sums[2]), non_blocking=True)
                if self.bounce is None or self.bounce.numel() != staging.numel():
                    began = time.perf_counter()
                    self.bounce = torch.empty(staging.numel(), dtype=torch.uint8, pin_memory=True)
                    w._setup_s += time.perf_counter() - began
                self.bounce.copy_(staging, non_blocking=True)
                deferred = [(self.bounce, host)]
            done.record(side)
        w._staged = (staged, device)
        return deferred, ("staged", done, sums, lay.start)

    def graph(self, key: Any, work: Callable[[], None], device: torch.device) -> Any:
        """The CUDA graph of `work` (captured once per staging buffer and key), or None where
        capturing fails (then this writer enqueues its work call by call from now on)."""
        if key in self.graphs:
            return self.graphs[key]
        began = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=torch.cuda.Stream(device), capture_error_mode="thread_local"):
                work()
        except Exception as exc:  # noqa: BLE001 - the eager path does the same work
            log.info("memory tier: cannot capture the copy as a CUDA graph (%s); enqueuing it call by call",
                     exc)
            self.writer.graphs = False
            graph = None
        self.graphs[key] = graph
        self.writer._setup_s += time.perf_counter() - began
        return graph
