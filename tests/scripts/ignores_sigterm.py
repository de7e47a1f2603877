"""A plain script (no runtime, no torch) that ignores SIGTERM: it says so, then sleeps, so
that stopping its group takes the node's whole cancel grace before the SIGKILL."""

import signal
import time

signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ignoring SIGTERM", flush=True)
time.sleep(3600)
