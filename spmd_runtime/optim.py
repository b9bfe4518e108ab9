"""Optimizers as traced code: the update is part of the training-step graph, so it partitions too.

Parameters, gradients and optimizer state are pytrees: ``params`` and ``grads``
are dicts name -> array, the state a nested dict (AdamW: ``{"step", "m": {name:
...}, "v": {name: ...}}``). ``state_layout(param_shapes)`` lists every state
array (its path in the state tree, shape, dtype, the parameter it belongs to or
None for a global scalar such as the step counter, and its flat name from before
state trees, ``m_<param>``, which old checkpoints use); ``init_state(params)``
builds the tree and the traced ``update(params, grads, state)`` returns
``(new params, new state)`` of the same structures. Per-parameter state has the
parameter's shape, so it can be laid out like the parameter or, for
weight-update sharding, split further. ``init_state`` of abstract parameters
(``TensorSpec``s, or any leaf with ``.shape`` and ``.dtype`` that holds no data,
like jax's ``ShapeDtypeStruct``) is the tree of the slots' TensorSpecs: a plan
allocates no state.

Hyperparameters are Python floats baked into the graph as constants.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from . import numpy as snp
from . import pytree
from .graph import TensorSpec


@dataclass(frozen=True)
class StateSlot:
    name: str  # the flat name checkpoints written before state trees use ("m_embed")
    shape: tuple[int, ...]
    dtype: str
    param: str | None  # the parameter this slot belongs to (same shape); None for a global scalar
    path: tuple = ()  # where the slot lives in the state tree: ("m", "embed"); () means (name,)

    @property
    def key(self) -> tuple:
        return self.path or (self.name,)


def slot_tree(slots, values) -> dict:
    """The nested dict with ``values`` (one per slot, in order) at the slots' paths."""
    tree: dict = {}
    for slot, value in zip(slots, values):
        *parents, last = slot.key
        node = tree
        for k in parents:
            node = node.setdefault(k, {})
        node[last] = value
    return tree


class Optimizer:
    """Base class: subclasses define ``_slots`` and the traced ``update``."""

    def state_layout(self, param_shapes: dict, dtype) -> list[StateSlot]:
        return self._slots(OrderedDict(param_shapes), np.dtype(dtype).name)

    def init_state(self, params: dict) -> dict:
        """The initial state tree for the dict ``params`` (zeros; counters at 0); for abstract ``params``
        (``is_abstract``) the tree of each slot's TensorSpec, allocating nothing."""
        dtype = next(iter(params.values())).dtype
        layout = self.state_layout({k: v.shape for k, v in params.items()}, dtype)
        if is_abstract(params):
            return slot_tree(layout, [TensorSpec(s.shape, s.dtype) for s in layout])
        return slot_tree(layout, [np.zeros(s.shape, s.dtype) for s in layout])

    def _slots(self, shapes, dtype) -> list[StateSlot]:
        raise NotImplementedError

    def update(self, params: dict, grads: dict, state: dict, matrices=None) -> tuple[dict, dict]:
        """Traced: (new params, new state) from the params, their gradients (same keys) and the state tree.
        ``matrices``: the names of the weight matrices (weight decay applies to them only); default: the
        params with 2 or more dims (a caller whose params stack layers on a leading dim names them)."""
        raise NotImplementedError

    def loss_scale(self, state: dict):
        """Traced: the factor the loss is multiplied by before differentiation (1: none)."""
        return 1.0


def is_abstract(tree) -> bool:
    """Whether the leaves of ``tree`` are shapes and dtypes without data: TensorSpecs, or objects with ``.shape``
    and ``.dtype`` that are no arrays (jax's ``ShapeDtypeStruct``); arrays (NumPy's, or any with ``__array__``)
    are concrete."""
    leaves = pytree.flatten(tree, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))[0]
    return bool(leaves) and all(isinstance(x, TensorSpec) or not (isinstance(x, (np.ndarray, np.generic))
                                                                  or hasattr(x, "__array__")) for x in leaves)


def is_matrix(name: str, p, matrices) -> bool:
    """Whether weight decay applies to ``p``: named in ``matrices``, or by default 2 or more dims."""
    return name in matrices if matrices is not None else p.ndim >= 2


def _per_param(prefix: str, shapes, dtype) -> list[StateSlot]:
    return [StateSlot(f"{prefix}_{name}", tuple(shape), dtype, name, (prefix, name)) for name, shape in shapes.items()]


@dataclass(frozen=True)
class SGD(Optimizer):
    """SGD with (heavy-ball) momentum and optional L2 weight decay on matrices:
    buf = momentum * buf + (g + wd * p);  p -= lr * buf."""
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 0.0

    def _slots(self, shapes, dtype):
        return _per_param("mom", shapes, dtype)

    def update(self, params, grads, state, matrices=None):
        new_params, new_bufs = {}, {}
        for name, p in params.items():
            g = grads[name]
            if self.weight_decay and is_matrix(name, p, matrices):
                g = g + self.weight_decay * p
            new_bufs[name] = self.momentum * state["mom"][name] + g
            new_params[name] = p - self.lr * new_bufs[name]
        return new_params, {"mom": new_bufs}


@dataclass(frozen=True)
class AdamW(Optimizer):
    """Adam with bias correction and decoupled weight decay (Loshchilov & Hutter) on matrices only
    (LayerNorm gains and biases are not decayed). Optional linear learning-rate warm-up.

    State: ``{"step": float32 0-d counter of updates taken, "m": first moments, "v": second moments}``
    (the moments are dicts name -> array like the parameters)."""
    lr: float = 1e-3
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    warmup: int = 0

    def _slots(self, shapes, dtype):
        return [StateSlot("step", (), "float32", None)] + _per_param("m", shapes, dtype) + _per_param("v", shapes,
                                                                                                      dtype)

    def update(self, params, grads, state, matrices=None):
        t = state["step"] + 1.0
        tt = snp.astype(t, next(iter(params.values())).dtype)
        lr = self._lr(tt)
        c1 = 1.0 / (1.0 - snp.power(np.asarray(self.b1, tt.dtype), tt))  # bias corrections
        c2 = 1.0 / (1.0 - snp.power(np.asarray(self.b2, tt.dtype), tt))
        new_params, new_m, new_v = {}, {}, {}
        for name, p in params.items():
            g = grads[name]
            m = new_m[name] = self.b1 * state["m"][name] + (1.0 - self.b1) * g
            v = new_v[name] = self.b2 * state["v"][name] + (1.0 - self.b2) * (g * g)
            direction = (m * c1) / (snp.sqrt(v * c2) + self.eps)
            if self.weight_decay and is_matrix(name, p, matrices):
                direction = direction + self.weight_decay * p
            new_params[name] = p - lr * direction
        return new_params, {"step": t, "m": new_m, "v": new_v}

    def _lr(self, t):
        if not self.warmup:
            return self.lr
        return self.lr * snp.minimum(t * (1.0 / self.warmup), 1.0)


@dataclass(frozen=True)
class DynamicLossScale(Optimizer):
    """Dynamic loss scaling around ``inner`` (for float16 gradients, Micikevicius et al. 2018): the loss is
    multiplied by ``loss_scale`` before differentiation and the gradients divided by it; when any gradient
    holds an inf or NaN the step is skipped (parameters and inner state unchanged) and the scale divided
    by ``factor``; after ``interval`` finite steps in a row it is multiplied by ``factor``.

    The finiteness test is one traced global reduction over every gradient, so all ranks agree on it even
    when the gradients are sharded (the partitioner all-reduces the partial flags).
    State: ``{"inner": the inner state, "loss_scale", "good_steps"}`` (float32 0-d scalars)."""
    inner: Optimizer = AdamW()
    initial: float = 2.0 ** 15
    interval: int = 200
    factor: float = 2.0
    min_scale: float = 1.0

    def _slots(self, shapes, dtype):
        inner = [dataclasses.replace(s, path=("inner",) + s.key) for s in self.inner._slots(shapes, dtype)]
        return inner + [StateSlot("loss_scale", (), "float32", None), StateSlot("good_steps", (), "float32", None)]

    def init_state(self, params):
        if is_abstract(params):
            return super().init_state(params)
        return {"inner": self.inner.init_state(params), "loss_scale": np.asarray(self.initial, np.float32),
                "good_steps": np.zeros((), np.float32)}

    def loss_scale(self, state):
        return state["loss_scale"]

    def update(self, params, grads, state, matrices=None):
        scale, good = state["loss_scale"], state["good_steps"]
        inv = 1.0 / scale
        grads = {n: g * snp.astype(inv, g.dtype) for n, g in grads.items()}
        # g * 0 is 0 for a finite g and NaN for inf/NaN: one sum per gradient flags any non-finite value.
        flags = [snp.sum(snp.astype(g, "float32") * 0.0) for g in grads.values()]
        finite = sum(flags[1:], flags[0]) == 0.0
        new_params, new_inner = self.inner.update(params, grads, state["inner"], matrices)
        keep = lambda new, old: snp.where(finite, new, old)
        new_params = pytree.tree_map(keep, new_params, params)
        new_inner = pytree.tree_map(keep, new_inner, state["inner"])
        good = snp.where(finite, good + 1.0, 0.0)
        grow = good >= float(self.interval)
        scale = snp.where(finite, snp.where(grow, scale * self.factor, scale),
                          snp.maximum(scale * (1.0 / self.factor), self.min_scale))
        return new_params, {"inner": new_inner, "loss_scale": scale, "good_steps": snp.where(grow, 0.0, good)}


OPTIMIZERS = {"sgd": SGD, "adamw": AdamW}


def make_optimizer(name: str, **hyper) -> Optimizer:
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}; got {name!r}")
    return OPTIMIZERS[name](**hyper)


__all__ = ["Optimizer", "SGD", "AdamW", "DynamicLossScale", "StateSlot", "slot_tree", "is_abstract", "OPTIMIZERS", "make_optimizer"]
