"""Optimizers as traced code: the update is part of the training-step graph, so it partitions too.

State layout is explicit: ``state_layout(param_shapes)`` lists every state array
(its name, shape, dtype and the parameter it belongs to, or None for a global
scalar such as the step counter), ``init_state(params)`` builds them in that
order, and the traced ``update(params, grads, state)`` takes and returns them in
that order. Per-parameter state has the parameter's shape, so it can be laid out
like the parameter or, for weight-update sharding, split further.

Hyperparameters are Python floats baked into the graph as constants.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from . import numpy as snp


@dataclass(frozen=True)
class StateSlot:
    name: str
    shape: tuple[int, ...]
    dtype: str
    param: str | None  # the parameter this slot belongs to (same shape); None for a global scalar


class Optimizer:
    """Base class: subclasses define ``_slots`` and the traced ``update``."""

    def state_layout(self, param_shapes: dict, dtype) -> list[StateSlot]:
        return self._slots(OrderedDict(param_shapes), np.dtype(dtype).name)

    def init_state(self, params: dict) -> "OrderedDict[str, np.ndarray]":
        """Initial state arrays, name -> array, in ``state_layout`` order (zeros; counters at 0)."""
        params = OrderedDict(params)
        dtype = next(iter(params.values())).dtype
        layout = self.state_layout({k: v.shape for k, v in params.items()}, dtype)
        return OrderedDict((s.name, np.zeros(s.shape, s.dtype)) for s in layout)

    def _slots(self, shapes, dtype) -> list[StateSlot]:
        raise NotImplementedError

    def update(self, params: list, grads: list, state: list) -> tuple[list, list]:
        """Traced: (new params, new state) from params, their gradients and the state (layout order)."""
        raise NotImplementedError

    def loss_scale(self, state: list):
        """Traced: the factor the loss is multiplied by before differentiation (1: none)."""
        return 1.0


def _per_param(prefix: str, shapes, dtype) -> list[StateSlot]:
    return [StateSlot(f"{prefix}_{name}", tuple(shape), dtype, name) for name, shape in shapes.items()]


@dataclass(frozen=True)
class SGD(Optimizer):
    """SGD with (heavy-ball) momentum and optional L2 weight decay on matrices:
    buf = momentum * buf + (g + wd * p);  p -= lr * buf."""
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 0.0

    def _slots(self, shapes, dtype):
        return _per_param("mom", shapes, dtype)

    def update(self, params, grads, state):
        new_params, new_bufs = [], []
        for p, g, buf in zip(params, grads, state):
            if self.weight_decay and p.ndim >= 2:
                g = g + self.weight_decay * p
            buf = self.momentum * buf + g
            new_bufs.append(buf)
            new_params.append(p - self.lr * buf)
        return new_params, new_bufs


@dataclass(frozen=True)
class AdamW(Optimizer):
    """Adam with bias correction and decoupled weight decay (Loshchilov & Hutter) on matrices only
    (LayerNorm gains and biases are not decayed). Optional linear learning-rate warm-up.

    State: ``step`` (float32 0-d counter of updates taken), then first moments ``m_<param>``, then
    second moments ``v_<param>``."""
    lr: float = 1e-3
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    warmup: int = 0

    def _slots(self, shapes, dtype):
        return [StateSlot("step", (), "float32", None)] + _per_param("m", shapes, dtype) + _per_param("v", shapes,
                                                                                                      dtype)

    def update(self, params, grads, state):
        n = len(params)
        step, ms, vs = state[0], state[1:1 + n], state[1 + n:]
        t = step + 1.0
        tt = snp.astype(t, params[0].dtype)
        lr = self._lr(tt)
        c1 = 1.0 / (1.0 - snp.power(np.asarray(self.b1, tt.dtype), tt))  # bias corrections
        c2 = 1.0 / (1.0 - snp.power(np.asarray(self.b2, tt.dtype), tt))
        new_params, new_m, new_v = [], [], []
        for p, g, m, v in zip(params, grads, ms, vs):
            m = self.b1 * m + (1.0 - self.b1) * g
            v = self.b2 * v + (1.0 - self.b2) * (g * g)
            direction = (m * c1) / (snp.sqrt(v * c2) + self.eps)
            if self.weight_decay and p.ndim >= 2:
                direction = direction + self.weight_decay * p
            new_params.append(p - lr * direction)
            new_m.append(m)
            new_v.append(v)
        return new_params, [t] + new_m + new_v

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
    State: the inner state, then ``loss_scale`` and ``good_steps`` (float32 0-d)."""
    inner: Optimizer = AdamW()
    initial: float = 2.0 ** 15
    interval: int = 200
    factor: float = 2.0
    min_scale: float = 1.0

    def _slots(self, shapes, dtype):
        return self.inner._slots(shapes, dtype) + [StateSlot("loss_scale", (), "float32", None),
                                                   StateSlot("good_steps", (), "float32", None)]

    def init_state(self, params):
        state = self.inner.init_state(params)
        state["loss_scale"] = np.asarray(self.initial, np.float32)
        state["good_steps"] = np.zeros((), np.float32)
        return state

    def loss_scale(self, state):
        return state[-2]

    def update(self, params, grads, state):
        scale, good = state[-2], state[-1]
        inv = 1.0 / scale
        grads = [g * snp.astype(inv, g.dtype) for g in grads]
        # g * 0 is 0 for a finite g and NaN for inf/NaN: one sum per gradient flags any non-finite value.
        flags = [snp.sum(snp.astype(g, "float32") * 0.0) for g in grads]
        finite = sum(flags[1:], flags[0]) == 0.0
        new_params, new_inner = self.inner.update(params, grads, state[:-2])
        keep = lambda new, old: snp.where(finite, new, old)
        new_params = [keep(n, p) for n, p in zip(new_params, params)]
        new_inner = [keep(n, o) for n, o in zip(new_inner, state[:-2])]
        good = snp.where(finite, good + 1.0, 0.0)
        grow = good >= float(self.interval)
        scale = snp.where(finite, snp.where(grow, scale * self.factor, scale),
                          snp.maximum(scale * (1.0 / self.factor), self.min_scale))
        return new_params, new_inner + [scale, snp.where(grow, 0.0, good)]


OPTIMIZERS = {"sgd": SGD, "adamw": AdamW}


def make_optimizer(name: str, **hyper) -> Optimizer:
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}; got {name!r}")
    return OPTIMIZERS[name](**hyper)


__all__ = ["Optimizer", "SGD", "AdamW", "DynamicLossScale", "StateSlot", "OPTIMIZERS", "make_optimizer"]
