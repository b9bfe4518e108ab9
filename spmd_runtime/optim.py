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

Hyperparameters are Python floats baked into the graph as constants. A learning rate may instead be a
``Schedule`` (``ConstantSchedule``, ``LinearSchedule``, ``CosineSchedule``: warm-up, then decay), a traced function
of the optimizer's step counter evaluated inside the step: decided once, nothing per step in Python.
``clip_norm`` (every optimizer) scales the gradients to at most that global L2 norm first (PyTorch's
``clip_grad_norm_``); the squares are summed per group of gradients split over the same mesh axes (``groups``,
which the training step takes from its layout), so the norm costs one reduction per group, not one per parameter.
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
    param: str | None  # the parameter this slot belongs to; None for a global scalar
    path: tuple = ()  # where the slot lives in the state tree: ("m", "embed"); () means (name,)
    dims: tuple | None = None  # the parameter's dims the slot keeps (factored moments); None: all (its shape)

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

    def update(self, params: dict, grads: dict, state: dict, matrices=None, groups=None) -> tuple[dict, dict]:
        """Traced: (new params, new state) from the params, their gradients (same keys) and the state tree.
        ``matrices``: the names of the weight matrices (weight decay applies to them only); default: the
        params with 2 or more dims (a caller whose params stack layers on a leading dim names them).
        ``groups``: the parameter names grouped by the mesh axes splitting their gradients, for ``clip_norm``'s
        global norm (``global_norm``); default one group."""
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


@dataclass(frozen=True)
class Schedule:
    """A learning rate as a function of ``count``, the number of updates taken before this one (0 at the first,
    as nanoGPT's ``iter_num`` and optax's ``count``): a linear warm-up from ``init`` to ``peak`` over ``warmup``
    updates, then the subclass's decay from ``peak`` (at count ``warmup``) to ``end`` (at count ``total``, and
    after it). Called on a traced 0-d count it returns the traced rate (inside the step)."""
    peak: float
    warmup: int = 0
    total: int = 0
    end: float = 0.0
    init: float = 0.0

    def __post_init__(self):
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"{type(self).__name__} warmup must be an int >= 0; got {self.warmup!r}")
        if self.decays and (not isinstance(self.total, int) or self.total <= self.warmup):
            raise ValueError(f"{type(self).__name__} total must be an int > warmup={self.warmup} (the update at "
                             f"which the decay ends); got total={self.total!r}")

    decays = True

    def __call__(self, count):
        rate = self._decayed(count)
        if not self.warmup:
            return rate
        warm = self.init + (self.peak - self.init) * (count * (1.0 / self.warmup))
        return snp.where(count < float(self.warmup), warm, rate)

    def _fraction(self, count):
        """How far the decay has gone, in [0, 1]."""
        return snp.clip((count - float(self.warmup)) * (1.0 / (self.total - self.warmup)), 0.0, 1.0)

    def _decayed(self, count):
        raise NotImplementedError


@dataclass(frozen=True)
class ConstantSchedule(Schedule):
    """``peak`` after the warm-up (``total`` and ``end`` unused)."""
    decays = False

    def _decayed(self, count):
        return self.peak


@dataclass(frozen=True)
class LinearSchedule(Schedule):
    """Linear decay from ``peak`` to ``end`` between counts ``warmup`` and ``total`` (optax's
    ``warmup_linear`` shape: ``linear_schedule`` joined after a warm-up)."""

    def _decayed(self, count):
        return self.peak + (self.end - self.peak) * self._fraction(count)


@dataclass(frozen=True)
class CosineSchedule(Schedule):
    """Half-cosine decay from ``peak`` to ``end`` between counts ``warmup`` and ``total``: optax's
    ``warmup_cosine_decay_schedule(init, peak, warmup, total, end)``; nanoGPT's ``get_lr`` is
    ``nanogpt_schedule``."""

    def _decayed(self, count):
        return self.end + (self.peak - self.end) * (0.5 * (1.0 + snp.cos(np.pi * self._fraction(count))))


def nanogpt_schedule(learning_rate: float, warmup_iters: int, lr_decay_iters: int, min_lr: float) -> CosineSchedule:
    """nanoGPT's ``get_lr(it)``: ``learning_rate * (it + 1) / (warmup_iters + 1)`` during the warm-up, which is a
    linear warm-up from ``learning_rate / (warmup_iters + 1)``, then cosine to ``min_lr`` at ``lr_decay_iters``."""
    return CosineSchedule(learning_rate, warmup_iters, lr_decay_iters, min_lr, learning_rate / (warmup_iters + 1))


def learning_rate(lr, count, dtype):
    """The rate for the update after ``count`` updates (traced): ``lr`` itself when it is a number."""
    return lr(snp.astype(count, dtype)) if isinstance(lr, Schedule) else lr


def global_norm(tree: dict, groups=None):
    """Traced: the L2 norm of every leaf of the dict ``tree`` together. ``groups``: lists of its keys whose
    leaves are split over the same mesh axes (every key in one of them); each group's squares are summed
    before the groups are added, so a group of sharded leaves is completed by ONE reduction (the pending sums of
    one group share their axes) and the norm costs one reduction per group. Default: one group, in order."""
    groups = [list(tree)] if groups is None else groups
    missing = set(tree) - {k for g in groups for k in g}
    if missing:
        raise ValueError(f"global_norm groups must hold every key of the tree; got {sorted(missing)} in none")
    square = lambda x: x * x
    sums = [_sum(snp.sum(square(snp.astype(tree[k], np.result_type(tree[k].dtype, np.float32)))) for k in group)
            for group in groups if group]  # 16-bit gradients squared and summed in float32
    return snp.sqrt(_sum(sums))


def clip_by_global_norm(tree: dict, max_norm: float, groups=None) -> dict:
    """Traced: ``tree`` scaled by ``min(1, max_norm / (norm + 1e-6))``, ``norm`` its ``global_norm``:
    PyTorch's ``clip_grad_norm_`` (nanoGPT's ``grad_clip``)."""
    if not max_norm or max_norm < 0:
        raise ValueError(f"clip_by_global_norm max_norm must be > 0; got {max_norm!r}")
    coef = snp.minimum(max_norm / (global_norm(tree, groups) + 1e-6), 1.0)
    return {k: g * snp.astype(coef, g.dtype) for k, g in tree.items()}


def _sum(values):
    values = list(values)
    total = values[0]
    for v in values[1:]:
        total = total + v
    return total


def _clipped(optimizer, grads: dict, groups) -> dict:
    return clip_by_global_norm(grads, optimizer.clip_norm, groups) if optimizer.clip_norm else grads


def _per_param(prefix: str, shapes, dtype) -> list[StateSlot]:
    return [StateSlot(f"{prefix}_{name}", tuple(shape), dtype, name, (prefix, name)) for name, shape in shapes.items()]


@dataclass(frozen=True)
class SGD(Optimizer):
    """SGD with (heavy-ball) momentum and optional L2 weight decay on matrices:
    buf = momentum * buf + (g + wd * p);  p -= lr * buf. With a ``Schedule`` as ``lr`` the state also counts the
    updates (``"step"``)."""
    lr: float | Schedule = 0.1
    momentum: float = 0.9
    weight_decay: float = 0.0
    clip_norm: float | None = None

    def _slots(self, shapes, dtype):
        counter = [StateSlot("step", (), "float32", None)] if isinstance(self.lr, Schedule) else []
        return counter + _per_param("mom", shapes, dtype)

    def update(self, params, grads, state, matrices=None, groups=None):
        grads = _clipped(self, grads, groups)
        counted = isinstance(self.lr, Schedule)
        lr = learning_rate(self.lr, state["step"], next(iter(params.values())).dtype) if counted else self.lr
        new_params, new_bufs = {}, {}
        for name, p in params.items():
            g = grads[name]
            if self.weight_decay and is_matrix(name, p, matrices):
                g = g + self.weight_decay * p
            new_bufs[name] = self.momentum * state["mom"][name] + g
            new_params[name] = p - lr * new_bufs[name]
        return new_params, {"mom": new_bufs, **({"step": state["step"] + 1.0} if counted else {})}


@dataclass(frozen=True)
class AdamW(Optimizer):
    """Adam with bias correction and decoupled weight decay (Loshchilov & Hutter) on matrices only
    (LayerNorm gains and biases are not decayed). ``lr``: a number (with ``warmup``, a linear warm-up to it
    over that many updates) or a ``Schedule``.

    State: ``{"step": float32 0-d counter of updates taken, "m": first moments, "v": second moments}``
    (the moments are dicts name -> array like the parameters)."""
    lr: float | Schedule = 1e-3
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    warmup: int = 0
    clip_norm: float | None = None

    def __post_init__(self):
        if self.warmup and isinstance(self.lr, Schedule):
            raise ValueError(f"AdamW warmup applies to a constant lr; give the Schedule its warmup instead; got "
                             f"warmup={self.warmup} with lr={self.lr}")

    def _slots(self, shapes, dtype):
        return [StateSlot("step", (), "float32", None)] + _per_param("m", shapes, dtype) + _per_param("v", shapes,
                                                                                                      dtype)

    def update(self, params, grads, state, matrices=None, groups=None):
        grads = _clipped(self, grads, groups)
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
        if isinstance(self.lr, Schedule):
            return self.lr(t - 1.0)  # t counts this update; a schedule takes the updates before it
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

    def update(self, params, grads, state, matrices=None, groups=None):
        scale, good = state["loss_scale"], state["good_steps"]
        inv = 1.0 / scale
        grads = {n: g * snp.astype(inv, g.dtype) for n, g in grads.items()}
        # g * 0 is 0 for a finite g and NaN for inf/NaN: one sum per gradient flags any non-finite value.
        flags = [snp.sum(snp.astype(g, "float32") * 0.0) for g in grads.values()]
        finite = sum(flags[1:], flags[0]) == 0.0
        new_params, new_inner = self.inner.update(params, grads, state["inner"], matrices, groups)
        keep = lambda new, old: snp.where(finite, new, old)
        new_params = pytree.tree_map(keep, new_params, params)
        new_inner = pytree.tree_map(keep, new_inner, state["inner"])
        good = snp.where(finite, good + 1.0, 0.0)
        grow = good >= float(self.interval)
        scale = snp.where(finite, snp.where(grow, scale * self.factor, scale),
                          snp.maximum(scale * (1.0 / self.factor), self.min_scale))
        return new_params, {"inner": new_inner, "loss_scale": scale, "good_steps": snp.where(grow, 0.0, good)}


@dataclass(frozen=True)
class Adafactor(Optimizer):
    """Adafactor (Shazeer & Stern 2018) with the defaults of T5 / Mesh TensorFlow / GShard: second moments of a
    matrix factored into row and column means (both dims >= ``min_dim_size_to_factor``; others keep a full
    second moment; ``factor``: over the last two dims, so the leading dim of stacked layers or experts keeps
    its own moments, as Praxis does for repeated layers, or over the two largest, Mesh TF's rule), decay 1 - t^-``decay_rate``, updates clipped to RMS
    ``clipping_threshold``, a relative step size min(1e-2, 1/sqrt(t)) (``lr`` None) times the parameter's RMS
    (at least ``eps2``, ``multiply_by_parameter_scale``), no first moment (``beta1`` 0). With ``lr`` set it is
    the step size before the parameter scale (a number or a ``Schedule``). ``weight_decay``: decoupled, lr * wd * p
    on matrices.

    State: ``{"step", "vr": {name: row means}, "vc": {name: column means}, "v": {name: full second moment}}``
    (each parameter in "vr"/"vc" or in "v"), and ``"m"`` when ``beta1`` > 0. A factored slot keeps the
    parameter's dims but one (``StateSlot.dims``), so a preset lays it out like the parameter on those dims."""
    lr: float | Schedule | None = None
    beta1: float = 0.0
    decay_rate: float = 0.8
    eps1: float = 1e-30
    eps2: float = 1e-3
    clipping_threshold: float | None = 1.0
    multiply_by_parameter_scale: bool = True
    min_dim_size_to_factor: int = 128
    weight_decay: float = 0.0
    factor: str = "last"  # which two dims: "last" or "largest" (the same for a matrix)
    clip_norm: float | None = None

    def __post_init__(self):
        if self.factor not in ("largest", "last"):
            raise ValueError(f"Adafactor factor must be 'largest' or 'last'; got {self.factor!r}")

    def factored_dims(self, shape) -> tuple[int, int] | None:
        """(row dim, column dim) of a factored second moment: the two largest dims in order (``factor``
        "largest", Mesh TF's rule) or the last two ("last"), or None when the smaller of them is below
        ``min_dim_size_to_factor`` (or ``shape`` is < 2-d)."""
        if len(shape) < 2:
            return None
        two = (sorted(range(len(shape)), key=lambda d: -shape[d])[:2] if self.factor == "largest"
               else [len(shape) - 2, len(shape) - 1])
        if min(shape[d] for d in two) < self.min_dim_size_to_factor:
            return None
        return min(two), max(two)

    def _slots(self, shapes, dtype):
        slots = [StateSlot("step", (), "float32", None)]
        for name, shape in shapes.items():
            factored = self.factored_dims(shape)
            if factored:
                for prefix, drop in (("vr", factored[1]), ("vc", factored[0])):
                    keep = tuple(d for d in range(len(shape)) if d != drop)
                    slots.append(StateSlot(f"{prefix}_{name}", tuple(shape[d] for d in keep), dtype, name,
                                           (prefix, name), keep))
            else:
                slots.append(StateSlot(f"v_{name}", tuple(shape), dtype, name, ("v", name)))
        return slots + (_per_param("m", shapes, dtype) if self.beta1 else [])

    def update(self, params, grads, state, matrices=None, groups=None):
        grads = _clipped(self, grads, groups)
        t = state["step"] + 1.0
        tt = snp.astype(t, next(iter(params.values())).dtype)
        decay = 1.0 - snp.power(tt, -self.decay_rate)
        step_size = snp.minimum(1.0 / snp.sqrt(tt), 1e-2) if self.lr is None else learning_rate(self.lr, tt - 1.0,
                                                                                                 tt.dtype)
        new_params, new_state = {}, {"step": t, "vr": {}, "vc": {}, "v": {}, "m": {}}
        for name, p in params.items():
            g = grads[name]
            squared = g * g + self.eps1
            factored = self.factored_dims(p.shape)
            if factored:
                r, c = factored
                vr = new_state["vr"][name] = decay * state["vr"][name] + (1.0 - decay) * snp.mean(squared, axis=c)
                vc = new_state["vc"][name] = decay * state["vc"][name] + (1.0 - decay) * snp.mean(squared, axis=r)
                row = vr / snp.mean(vr, axis=r, keepdims=True)  # vr lacks dim c, so r is still its index r
                x = g / snp.sqrt(snp.expand_dims(row, c)) / snp.sqrt(snp.expand_dims(vc, r))
            else:
                v = new_state["v"][name] = decay * state["v"][name] + (1.0 - decay) * squared
                x = g / snp.sqrt(v)
            if self.clipping_threshold:
                x = x / snp.maximum(_rms(x) * (1.0 / self.clipping_threshold), 1.0)
            lr = step_size * snp.maximum(_rms(p), self.eps2) if self.multiply_by_parameter_scale else step_size
            update = lr * x
            if self.beta1:
                update = new_state["m"][name] = self.beta1 * state["m"][name] + (1.0 - self.beta1) * update
            if self.weight_decay and is_matrix(name, p, matrices):
                update = update + lr * self.weight_decay * p
            new_params[name] = p - update
        return new_params, {k: v for k, v in new_state.items() if k == "step" or v}  # the slots init_state made


def _rms(x):
    """Root mean square of every element of ``x`` (a 0-d tensor)."""
    return snp.sqrt(snp.mean(x * x))


OPTIMIZERS = {"sgd": SGD, "adamw": AdamW, "adafactor": Adafactor}


def make_optimizer(name: str, **hyper) -> Optimizer:
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}; got {name!r}")
    return OPTIMIZERS[name](**hyper)


__all__ = ["Optimizer", "SGD", "AdamW", "Adafactor", "DynamicLossScale", "StateSlot", "slot_tree", "is_abstract",
           "OPTIMIZERS", "make_optimizer", "Schedule", "ConstantSchedule", "LinearSchedule", "CosineSchedule",
           "nanogpt_schedule", "learning_rate", "global_norm", "clip_by_global_norm"]
