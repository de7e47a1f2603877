"""A worker's RNG states (Python's, numpy's, torch's, CUDA's): what a snapshot keeps of each
rank, taken at every step boundary when the memory tier notes them, so their capture is cheap."""

from __future__ import annotations

import ctypes
import random
from typing import Any

import torch


class _HostRng:
    """The Python and numpy global RNGs' states, taken every step boundary (`worker.step_marks.StepMarks.mark`)
    at little cost: the object last taken is given again while the state is the same, so that
    the RNG ring can reuse its pickle (`worker.memory.RngKeeper`). numpy's `get_state` alone cost 74 us
    on an H100 host (its MT19937 key copied number by number); its raw state is read instead
    (2.5 KB), and `get_state` called only when that moved. Exact: the legacy generator's
    cached Gaussian can only appear through a draw, which moves the raw state, so a state
    taken with no cached Gaussian stays the state while the raw one does not move."""

    def __init__(self):
        self.python: tuple | None = None
        self.numpy: tuple | None = None
        self._raw = b""
        self._probe: tuple[Any, int] | None = None  # (bit generator, address of its raw state)
        try:
            import numpy as np

            self._np = np
        except ImportError:
            self._np = None

    def python_state(self) -> tuple:
        state = random.getstate()
        if state != self.python:
            self.python = state
        return self.python

    def numpy_state(self) -> tuple | None:
        np = self._np
        if np is None:
            return None
        try:
            bg = np.random.mtrand._rand._bit_generator
            if self._probe is None or self._probe[0] is not bg:
                self._probe = (bg, bg.ctypes.state_address if type(bg).__name__ == "MT19937" else 0)
            address = self._probe[1]
        except AttributeError:  # another numpy: no probe
            address = 0
        if not address:
            return np.random.get_state()
        raw = ctypes.string_at(address, _MT19937_BYTES)
        if raw != self._raw or self.numpy is None or self.numpy[3]:  # moved, or a Gaussian cached
            self.numpy, self._raw = np.random.get_state(), raw
        return self.numpy


_MT19937_BYTES = 624 * 4 + 4  # numpy's mt19937_state: the key, then its position
_HOST_RNG = _HostRng()


def rng_state() -> dict:
    """This process's RNG states now."""
    state: dict[str, Any] = {"python": _HOST_RNG.python_state(), "torch": torch.get_rng_state()}
    numpy_state = _HOST_RNG.numpy_state()
    if numpy_state is not None:
        state["numpy"] = numpy_state
    if torch.cuda.is_initialized():  # what get_rng_state_all gives, without its per-device checks
        state["cuda"] = [g.get_state() for g in torch.cuda.default_generators]
    return state


def set_rng_state(state: dict) -> None:
    """Put back the states `rng_state` took."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
