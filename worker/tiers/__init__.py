"""Where a worker keeps snapshots of its training state: the contract in `api.py`, one tier
per module (`disk.py`, `memory.py`, `peer.py`). `worker/runtime.py` stands over them."""
