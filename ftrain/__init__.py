"""ftrain's import name for training scripts: `from ftrain import runtime`.

The project's own packages are the top-level `service` and `worker`. A user's project may
have a `worker.py` or a `service/` of its own, and a job's processes run in the user's
working directory, first on `sys.path`: under those names the user's would shadow ftrain's,
and ftrain's would shadow the user's. So every process that runs in a job's directory
(torchrun's rendezvous backend, the fork server, the workers) imports the node side as
`ftrain.worker` (the same files: `ftrain/worker/__init__.py` points there), and the user's
`import worker` is the user's own.
"""
