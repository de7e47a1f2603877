"""`worker/` under the name `ftrain.worker` (the package docstring of `ftrain` says why): its
modules import one another relatively, so they are the same under either name."""

import os as _os

__path__ = [_os.path.join(_os.path.dirname(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))),
                          "worker")]
