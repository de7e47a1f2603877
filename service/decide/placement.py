"""Which nodes a job may be placed on: the job's needs against a node's resources.

A job that sets `gpus_per_node` goes only to nodes reporting at least that many GPUs
(`worker/gpus.py`: nvidia-smi's list narrowed by the node's CUDA_VISIBLE_DEVICES); a job
that sets none goes anywhere. Pure: `scheduling.plan` asks it of every free node.
"""

from __future__ import annotations

from service.models import JobSpec, NodeRecord


def fits(spec: JobSpec, node: NodeRecord) -> bool:
    """`node` has what `spec` asks of each node it runs on."""
    return spec.gpus_per_node is None or node.gpus >= spec.gpus_per_node


def unfit_reason(spec: JobSpec, node: NodeRecord) -> str | None:
    """Why `node` cannot take `spec` (None: it can), in words for an event or a status."""
    if not fits(spec, node):
        return f"node {node.name} has {node.gpus} GPU(s), the job needs {spec.gpus_per_node}"
    return None
