"""Every environment variable ftrain reads or sets, one name per meaning.

Each constant's value is the variable's own name, so a grep for the name finds both this
definition and every use. Three tokens, three names: `FTRAIN_TOKEN` is a user's token as
the CLI reads it, `FTRAIN_NODE_TOKEN` the node agents' token, `FTRAIN_JOB_TOKEN` the job
token that an agent gives its workers (and a plain `torchrun --rdzv-backend=ftrain`
reads). A token never leaves the process it was given to under another name.

`worker/launch.py` (run with `python -S`, before site-packages exist) and
`worker/fork_server.py` (run as a file) import only the standard library, so they repeat
the one name each reads; tests/worker/test_env.py checks that they match this module.
"""

from __future__ import annotations

# ---------------------------------------------------------------- given to each worker
# The node agent sets these for every worker of a job (torchrun passes them on).
FTRAIN_JOB_ID = "FTRAIN_JOB_ID"
FTRAIN_ATTEMPT = "FTRAIN_ATTEMPT"  # the job attempt the worker belongs to (fencing)
FTRAIN_SERVER = "FTRAIN_SERVER"  # the control plane's URL, or several comma-separated (also the CLI's)
FTRAIN_JOB_TOKEN = "FTRAIN_JOB_TOKEN"  # the job's token: rendezvous, snapshots, progress
FTRAIN_NODE = "FTRAIN_NODE"  # the name of the node the worker runs on
FTRAIN_SNAPSHOT_DIR = "FTRAIN_SNAPSHOT_DIR"
FTRAIN_SNAPSHOT_EVERY = "FTRAIN_SNAPSHOT_EVERY"
FTRAIN_SNAPSHOT_KEEP = "FTRAIN_SNAPSHOT_KEEP"
FTRAIN_GLOBAL_BATCH_SIZE = "FTRAIN_GLOBAL_BATCH_SIZE"
FTRAIN_FORK_SERVER_SOCKET = "FTRAIN_FORK_SERVER_SOCKET"  # the abstract socket of the job's fork server
FTRAIN_MEMORY_DIR = "FTRAIN_MEMORY_DIR"  # the node's memory tier for the job (worker/memory.py), the agent's
# Set by torchrun's rendezvous handler for the workers of each round it forms: '<node>/<round>'
# of group rank 0 (worker/rendezvous/rounds.py); rank 0 sends it with its progress, so the
# control plane tells the new group's first step from a late one of the group it replaced.
FTRAIN_GROUP = "FTRAIN_GROUP"
# Set by the same handler for the workers of every round it forms: the round (torch's), which
# each worker's launcher notes beside its output files; the agent tags the worker's lines with
# it (`LogLineIn.round`; worker/launch.py and worker/output.py).
FTRAIN_ROUND = "FTRAIN_ROUND"

# ---------------------------------------------------------------- a job's own knobs
# The only FTRAIN_* names a job spec's `env` may set (service/models.py refuses the others).
FTRAIN_LOG_LEVEL = "FTRAIN_LOG_LEVEL"
FTRAIN_FORK_SERVER = "FTRAIN_FORK_SERVER"  # "0": workers start cold, without the fork server
FTRAIN_FORK_SERVER_IMPORTS = "FTRAIN_FORK_SERVER_IMPORTS"  # comma-separated modules it preloads
# Seconds a forked worker whose script returned may spend joining its non-daemon threads and
# running atexit handlers before it is ended anyway (worker/fork_server.py).
FTRAIN_EXIT_TIMEOUT_S = "FTRAIN_EXIT_TIMEOUT_S"
# Steps between two copies into the memory tier (1: every step; 0: no memory tier; unset: as
# often as fits 5% of the step time, worker/step_timing.py MEMORY_BUDGET).
FTRAIN_MEMORY_EVERY = "FTRAIN_MEMORY_EVERY"
# "0": a runtime worker whose process group broke does not copy the state of its last step
# into its node's memory tier before it exits (its last words, worker/last_words.py; on by
# default, on CPU and GPU), nor notes each step for them (RNG states kept at copy steps only).
FTRAIN_LAST_WORDS = "FTRAIN_LAST_WORDS"
# "0": a runtime worker on a GPU does not warm CUDA up (a cuBLAS handle, the autograd thread,
# common kernels) on a thread of its own while its process group starts (worker/runtime.py).
FTRAIN_CUDA_WARMUP = "FTRAIN_CUDA_WARMUP"
# A standby per local rank, forked by the job's fork server ahead of the next worker, that has
# made CUDA's context and loaded NCCL's kernels (worker/standby.py): "0" none, "1" even on a
# node without an NVIDIA device (warming nothing up), unset: on nodes with one.
FTRAIN_WORKER_STANDBY = "FTRAIN_WORKER_STANDBY"
# The node agent's bound on the lines of one job attempt queued for shipping (default 50,000;
# worker/log_shipper.py MAX_PENDING_LINES): tests make it small to flood it cheaply.
FTRAIN_LOG_QUEUE_LINES = "FTRAIN_LOG_QUEUE_LINES"
# Seconds rank 0's end waits for its snapshots' commits before it leaves those the control
# plane has not taken to its node agent (default 10; worker/handoff.py).
FTRAIN_COMMIT_WAIT_S = "FTRAIN_COMMIT_WAIT_S"
JOB_KNOBS = (FTRAIN_LOG_LEVEL, FTRAIN_FORK_SERVER, FTRAIN_FORK_SERVER_IMPORTS, FTRAIN_EXIT_TIMEOUT_S,
             FTRAIN_MEMORY_EVERY, FTRAIN_CUDA_WARMUP, FTRAIN_WORKER_STANDBY, FTRAIN_COMMIT_WAIT_S,
             FTRAIN_LAST_WORDS)

# ---------------------------------------------------------------- credentials
FTRAIN_TOKEN = "FTRAIN_TOKEN"  # a user's token, read by the CLI (`ftrain submit`, ...)
FTRAIN_USER_TOKEN = "FTRAIN_USER_TOKEN"  # the user token `ftrain serve` accepts
FTRAIN_NODE_TOKEN = "FTRAIN_NODE_TOKEN"  # the node (bootstrap) token: `ftrain node` registers with it

# ---------------------------------------------------------------- control plane and CLI
FTRAIN_ETCD_ENDPOINTS = "FTRAIN_ETCD_ENDPOINTS"
FTRAIN_ETCD_USER = "FTRAIN_ETCD_USER"  # the etcd user `ftrain serve` authenticates as
FTRAIN_ETCD_PASSWORD_FILE = "FTRAIN_ETCD_PASSWORD_FILE"  # the file holding that user's password
FTRAIN_ETCD_BIN = "FTRAIN_ETCD_BIN"  # the etcd binary `ftrain up` starts (else etcd on PATH)
FTRAIN_SNAPSHOT_ROOT = "FTRAIN_SNAPSHOT_ROOT"
FTRAIN_SECRET_DIR = "FTRAIN_SECRET_DIR"  # the control plane's secret and the jobs' secret env
FTRAIN_LOG_ROOT = "FTRAIN_LOG_ROOT"  # where the control plane keeps the workers' logs
FTRAIN_LOG_CAP_BYTES = "FTRAIN_LOG_CAP_BYTES"  # bytes of log kept per job
# service/settings.py reads every other setting as FTRAIN_<FIELD> (FTRAIN_NODE_TTL_S, ...).
SETTINGS_PREFIX = "FTRAIN_"

# ---------------------------------------------------------------- measuring
# A file the node's torchrun appends its re-rendezvous phase marks to (JSON lines; set by
# bench/recovery.py in each agent's environment; worker/rendezvous/marks.py). Unset: none.
FTRAIN_PHASE_LOG = "FTRAIN_PHASE_LOG"

# ---------------------------------------------------------------- torch's, set by ftrain
# Restarts with torch's shared rendezvous TCPStore can hang (pytorch #135712).
TORCH_DISABLE_SHARE_RDZV_TCP_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
# Every node runs the same number of workers (a job's nproc_per_node that is not "auto"):
# torch's agent then computes the ranks instead of exchanging them through the rendezvous
# store after each round (four requests to the control plane, and a wait for the slowest node).
TORCH_ELASTIC_WORKER_IDENTICAL = "TORCH_ELASTIC_WORKER_IDENTICAL"

# ---------------------------------------------------------------- torch's, read by ftrain
# What torchrun sets for each worker: its restart count, which names the folder of its output
# files under --log-dir (worker/output.py).
TORCHELASTIC_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
# The error file torchrun names for each worker, in its folder of output files: the folder
# where a worker's stacks are dumped (worker/stacks.py).
TORCHELASTIC_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"

# The flight recorder's ring of collectives per process (worker/flight.py): torch reads the
# first, or the NCCL-era second, when a process group is created; 0 records nothing.
TORCH_FR_BUFFER_SIZE = "TORCH_FR_BUFFER_SIZE"
TORCH_NCCL_TRACE_BUFFER_SIZE = "TORCH_NCCL_TRACE_BUFFER_SIZE"
