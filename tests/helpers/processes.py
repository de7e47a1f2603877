"""Real processes for integration tests: etcd, the control plane (uvicorn), node agents.

The harness is `bench/harness.py`, shared with the benchmarks; the tests keep importing
these names from here.
"""

from bench.harness import REPO as REPO
from bench.harness import ControlPlane as ControlPlane
from bench.harness import EtcdProcess as EtcdProcess
from bench.harness import NodeAgentProc as NodeAgentProc
from bench.harness import descendants as descendants
from bench.harness import free_port as free_port
from bench.harness import pid_alive as pid_alive
from bench.harness import stop_tree as stop_tree
from bench.harness import wait_for as wait_for
