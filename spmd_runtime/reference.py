"""The reference evaluator: runs the unpartitioned graph in one process.

Every correctness test compares a partitioned run against this.
"""
from __future__ import annotations

import numpy as np

from .graph import Graph
from .opdef import lookup


def evaluate(graph: Graph, *inputs, xp=np):
    """Evaluate ``graph`` on global ``inputs``; returns the list of outputs."""
    if len(inputs) != len(graph.params):
        raise ValueError(f"evaluate needs one input per graph parameter ({graph.param_names}); got {len(inputs)}")
    env = {}
    for pid, x, spec in zip(graph.params, inputs, graph.input_specs):
        x = xp.asarray(x)
        if tuple(x.shape) != spec.shape or x.dtype != np.dtype(spec.dtype):
            raise ValueError(f"input {graph.nodes[pid].attrs['name']!r} must be {spec}; got "
                             f"{x.dtype.name}{list(x.shape)}")
        env[pid] = x
    for node in graph.nodes:
        if node.id not in env:  # parameters are the inputs
            env[node.id] = lookup(node.op).kernel(xp, *[env[i] for i in node.inputs], **node.attrs)
    return [xp.asarray(env[o]) for o in graph.outputs]
