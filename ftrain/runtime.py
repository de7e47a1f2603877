"""The training runtime (`worker/runtime.py`), as `from ftrain import runtime`: this name is
the module itself, not a copy."""

import sys

from ftrain.worker import runtime as _runtime

sys.modules[__name__] = _runtime
