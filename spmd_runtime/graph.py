"""The traced computation graph: a flat, topologically ordered list of nodes.

Every node has one result with a static global shape and dtype. Operands are
node ids. Binary elementwise ops always see equal shapes: tracing inserts
explicit ``broadcast_in_dim`` nodes, as XLA does, so no partitioning rule has to
reason about implicit broadcasting. A node's ``op`` is the name of its record in
``spmd_runtime.opdef``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from .opdef import define

# The records of the two leaves tracing itself emits: a graph's inputs and the user's sharding annotations (their
# kernels and rules are ops/core.py's and the layers'; defined here so the graph and the tracer can name them).
PARAMETER = define("parameter", read_only=True)  # the caller's array
MESH_SPLIT = define("mesh_split")

@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of a traced function's argument."""
    __pytree_leaf__ = True  # a leaf of argument trees (as jax's ShapeDtypeStruct), not a node of its fields
    shape: tuple[int, ...]
    dtype: str = "float32"  # JAX's and torch's default

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "dtype", np.dtype(self.dtype).name)
        if any(s < 0 for s in self.shape):
            raise ValueError(f"a TensorSpec shape has non-negative dims; got {self.shape}")

    def __str__(self):
        return f"{self.dtype}{list(self.shape)}"

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize

    @classmethod
    def of(cls, x) -> "TensorSpec":
        if isinstance(x, TensorSpec):
            return x
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            return cls(tuple(x.shape), np.dtype(x.dtype).name)
        raise TypeError(f"an argument spec is a TensorSpec or an array; got {type(x).__name__}")


@dataclass(eq=False)
class Node:
    id: int
    op: str
    inputs: tuple[int, ...]
    attrs: dict
    shape: tuple[int, ...]
    dtype: str
    source: tuple | None = None  # (file, line) of the user's code that emitted it (JAX's source_info), or None

    @property
    def spec(self) -> TensorSpec:
        return TensorSpec(self.shape, self.dtype)

    @property
    def where(self) -> str:
        """``model.py:12``, the user's line that made this node ('' when unknown)."""
        return "" if self.source is None else f"{os.path.basename(self.source[0])}:{self.source[1]}"


@dataclass(eq=False)
class Graph:
    nodes: list[Node] = field(default_factory=list)
    params: list[int] = field(default_factory=list)
    param_names: list[str] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    scalar_args: dict = field(default_factory=dict)  # parameter node id -> what a Python number argument is
    in_tree: object = None  # pytree structure of the traced function's arguments (a tuple of them)
    out_tree: object = None  # ... and of its result; leaves are params / outputs in order

    def add(self, op: str, inputs, attrs, shape, dtype, source=None) -> Node:
        node = Node(len(self.nodes), op, tuple(inputs), dict(attrs), tuple(int(s) for s in shape),
                    np.dtype(dtype).name, source)
        self.nodes.append(node)
        return node

    def __getitem__(self, i: int) -> Node:
        return self.nodes[i]

    def capture(self, t) -> int:
        """The id of this graph's value standing for ``t``, a tensor of another trace: only a loop or branch
        body (``bodies.BodyGraph``) takes those, as parameters."""
        raise ValueError(f"a traced tensor belongs to one trace; got tensor %{t.id} {t.node.spec} of another "
                         f"trace (values of an enclosing function may be used inside sr.scan/while_loop/cond "
                         f"bodies only)")

    def users(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {n.id: [] for n in self.nodes}
        for n in self.nodes:
            for i in n.inputs:
                out[i].append(n.id)
        return out

    @property
    def input_specs(self) -> list[TensorSpec]:
        return [self.nodes[p].spec for p in self.params]

    @property
    def output_specs(self) -> list[TensorSpec]:
        return [self.nodes[o].spec for o in self.outputs]

    def name_of(self, node_id: int) -> str | None:
        """The user's name for a value: a parameter's name or ``mesh_split(..., name=...)``."""
        node = self.nodes[node_id]
        return node.attrs.get("name") if node.op in (PARAMETER.name, MESH_SPLIT.name) else None

    def __str__(self):
        lines = [f"graph({', '.join(f'{n}: {self.nodes[p].spec}' for n, p in zip(self.param_names, self.params))})"]
        for n in self.nodes:
            attrs = ", ".join(f"{k}={_short(v)}" for k, v in n.attrs.items())
            args = ", ".join(f"%{i}" for i in n.inputs)
            where = f"  # {n.where}" if n.source else ""
            lines.append(f"  %{n.id} = {n.op}({args}{', ' if args and attrs else ''}{attrs}) : {n.spec}{where}")
        lines.append(f"  return {', '.join(f'%{o}' for o in self.outputs)}")
        return "\n".join(lines)


def _short(v):
    if isinstance(v, np.ndarray):
        return f"array{list(v.shape)}" if v.size > 4 else repr(v.tolist())
    return str(v)
