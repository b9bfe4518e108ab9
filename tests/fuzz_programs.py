"""Random programs for differential fuzzing: partitioned result == reference evaluator.

``random_case(seed)`` is deterministic in the seed, so every MPI rank builds the same
program, and a failing seed is a complete reproduction (see test_fuzz_regressions.py).
Programs chain random ops of the op set (elementwise, broadcasting, reductions,
transpose, reshape, einsum with fresh operands, where, casts, take, cumsum, arg-reductions,
logsumexp, pooling, 1-d conv, slicing, flip, pad, concatenate, dynamic_slice, roll, slices of split dims, erf /
erfc / random noise / dropout, and
on split dims: roll, wide windows, unaligned reshapes, the kernel-gradient conv, interior pad, dynamic updates,
max / min pooling gradients)
with random mesh_split
annotations; meshes have 1 to 8 devices, 1-d and 2-d, sometimes reordered; sizes are
often uneven. Values are kept bounded (tanh squashing) so float64 tolerances stay tight.
With ``loops=True`` a case ends with one or two loops over pool tensors (``_Builder.scan_``, ``while_``: scans whose
bodies make, hand on, take from xs, swap or share their carries; a while loop updating a pool tensor), drawn
after the other ops so that every seed's program without loops stays what it was.
"""
from __future__ import annotations

import string
from dataclasses import dataclass

import numpy as np

import spmd_runtime as sr
import spmd_runtime.nn as snn
import spmd_runtime.numpy as snp
import spmd_runtime.random as srandom
from spmd_runtime.exec.backend import to_host
from spmd_runtime.ops.core import with_gradients

MESH_SHAPES = [(1,), (2,), (3,), (4,), (6,), (8,), (2, 2), (2, 3), (3, 2), (2, 4), (4, 2), (1, 4)]
SIZES = [1, 2, 3, 4, 5, 6, 7, 8, 10, 12]


@dataclass
class FuzzCase:
    seed: int
    mesh: sr.Mesh
    graph: sr.Graph
    inputs: list
    in_specs: list
    out_specs: list

    def __str__(self):
        return f"seed {self.seed} on {self.mesh}: in_specs {self.in_specs} out_specs {self.out_specs}\n{self.graph}"


def random_mesh(rng, max_devices=8, devices=None) -> sr.Mesh:
    """A random 1-d or 2-d mesh of at most ``max_devices`` (exactly ``devices`` when given)."""
    if devices is None:
        shapes = [s for s in MESH_SHAPES if int(np.prod(s)) <= max_devices]
    else:
        shapes = sorted({s for s in MESH_SHAPES + [(devices,)] if int(np.prod(s)) == devices})
    shape = shapes[rng.integers(len(shapes))]
    names = ("x", "y")[:len(shape)]
    n = int(np.prod(shape))
    devices = tuple(rng.permutation(n).tolist()) if rng.random() < 0.2 else None
    return sr.Mesh(shape, names, devices)


def random_sharding(rng, mesh, ndim):
    """Each mesh axis goes to a random dim or nowhere; order within a dim random."""
    dims = [[] for _ in range(ndim)]
    for a in rng.permutation(mesh.axis_names).tolist():
        d = rng.integers(ndim + 1)
        if d < ndim:
            dims[d].append(a)
    return tuple(tuple(d) if d else None for d in dims)


class _Builder:
    """Applies random ops to a pool of traced tensors."""

    def __init__(self, rng, mesh, params):
        self.rng, self.mesh, self.params, self.pool = rng, mesh, params, list(params.values())
        self.extra_shapes: list = []

    def pick(self):
        return self.pool[self.rng.integers(len(self.pool))]

    def step(self):
        ops = [self.unary, self.binary_same, self.binary_broadcast, self.reduce, self.transpose, self.reshape,
               self.einsum, self.annotate, self.where, self.cast, self.take, self.cumsum, self.arg_reduce,
               self.logsumexp, self.pooling, self.conv1d, self.slice_, self.flip, self.pad, self.concat,
               self.dynamic_slice, self.top_k, self.roll, self.split_slice, self.split_family, self.numpy_family,
               self.math_, self.index_arrays, self.at_update]
        ops.append(self.special_random)
        ops.append(self.injected_gradient)
        out = ops[self.rng.integers(len(ops))](self.pick())
        if out is not None:
            self.pool.append(out)

    def unary(self, t):
        f = [lambda v: snp.tanh(v), lambda v: snp.exp(snp.tanh(v)), lambda v: snp.log(snp.abs(v) + 1.0),
             lambda v: snp.sqrt(snp.abs(v)), lambda v: -v, lambda v: snp.abs(v)]
        return f[self.rng.integers(len(f))](t)

    def math_(self, t):
        """The elementwise math of ops/core.py, continuous ones only (a floor or a remainder would turn a last-bit
        difference of a partitioned sum into a jump), kept finite by their domains."""
        others = [o for o in self.pool if o.shape == t.shape]
        o = others[self.rng.integers(len(others))]
        f = [lambda v, w: snp.sin(v) * snp.cos(w), lambda v, w: snp.arctan(v) + snp.arcsin(snp.tanh(w)),
             lambda v, w: snp.log1p(snp.abs(v)) - snp.expm1(snp.tanh(w)), lambda v, w: snp.sigmoid(v) * w,
             lambda v, w: snp.rsqrt(v * v + 1.0), lambda v, w: snp.cbrt(v) + snp.sinh(snp.tanh(w)),
             lambda v, w: snp.clip(v, -0.5, 0.5), lambda v, w: snp.hypot(v, w),
             lambda v, w: snp.arctan2(v, w * w + 1.0), lambda v, w: snp.logaddexp(v, w),
             lambda v, w: snp.fmax(v, w) - snp.fmin(v, 0.25), lambda v, w: snp.arctanh(snp.tanh(v) * 0.5),
             lambda v, w: snp.log2(snp.abs(v) + 1.0) + snp.exp2(snp.tanh(w))]
        return f[self.rng.integers(len(f))](t, o)

    def binary_same(self, t):
        others = [o for o in self.pool if o.shape == t.shape]
        o = others[self.rng.integers(len(others))]
        f = [lambda a, b: a + b, lambda a, b: a - b, lambda a, b: a * b, lambda a, b: a / (snp.abs(b) + 1.0),
             snp.maximum, snp.minimum]
        return f[self.rng.integers(len(f))](t, o)

    def binary_broadcast(self, t):
        if t.ndim == 0:
            return None
        axis = int(self.rng.integers(t.ndim))
        return t - snp.max(t, axis=axis, keepdims=True) if self.rng.random() < 0.5 else \
            t * snp.mean(t, axis=axis, keepdims=True)

    def reduce(self, t):
        if t.ndim == 0:
            return None
        axes = tuple(sorted(set(self.rng.integers(t.ndim, size=self.rng.integers(1, t.ndim + 1)).tolist())))
        kind = [snp.sum, snp.max, snp.min, snp.mean][self.rng.integers(4)]
        return snp.tanh(kind(t, axis=axes, keepdims=bool(self.rng.random() < 0.3)))

    def transpose(self, t):
        return snp.transpose(t, self.rng.permutation(t.ndim).tolist()) if t.ndim > 1 else None

    def reshape(self, t):
        if t.ndim >= 2 and self.rng.random() < 0.5:
            i = int(self.rng.integers(t.ndim - 1))
            return t.reshape(t.shape[:i] + (t.shape[i] * t.shape[i + 1],) + t.shape[i + 2:])
        splittable = [i for i, n in enumerate(t.shape) if n in (4, 6, 8, 10, 12)]
        if not splittable or t.ndim >= 4:
            return None
        i = splittable[self.rng.integers(len(splittable))]
        return t.reshape(t.shape[:i] + (2, t.shape[i] // 2) + t.shape[i + 1:])

    def einsum(self, t):
        """Contract t with a fresh input over some of its dims (batch, contracting and free letters)."""
        if t.ndim == 0 or t.ndim > 3:
            return None
        letters = string.ascii_lowercase[:t.ndim]
        keep = [c for c in letters if self.rng.random() < 0.5]
        new = "".join(string.ascii_lowercase[10:10 + int(self.rng.integers(0, 2))])
        other_term = "".join(c for c in letters if self.rng.random() < 0.7) + new
        if not other_term:
            return None
        sizes = dict(zip(letters, t.shape)) | {c: SIZES[self.rng.integers(len(SIZES))] for c in new}
        other = self.new_param(tuple(sizes[c] for c in other_term))
        out = "".join(dict.fromkeys(keep + [c for c in other_term if c not in letters]))
        out = out if out else ""
        return snp.tanh(snp.einsum(f"{letters},{other_term}->{out}", t, other))

    def annotate(self, t):
        return sr.mesh_split(t, self.mesh, random_sharding(self.rng, self.mesh, t.ndim))

    def where(self, t):
        return snp.where(t > 0.1, t, t * 0.5)

    def cast(self, t):
        return snp.astype(snp.astype(t, "float32"), "float64") * 1.0

    def take(self, t):
        """Embedding-style lookup of t's rows (any axis) by indices made from a fresh input."""
        if t.ndim == 0 or t.ndim > 2:
            return None
        axis = int(self.rng.integers(t.ndim))
        u = self.new_param((SIZES[self.rng.integers(len(SIZES))],))
        indices = snp.astype(snp.abs(u) * t.shape[axis], "int64")  # out of range: clamped, wrapped or filled
        mode = ("clip", "wrap", "fill")[self.rng.integers(3)]
        return snp.take(t, indices, axis=axis, mode=mode, fill_value=0.5 if mode == "fill" else None)

    def index_arrays(self, t):
        """NumPy advanced indexing: an index array on one dim (constant, negatives included) and, on a rank >= 2
        tensor, a traced one from data on another (clamped)."""
        if t.ndim == 0:
            return None
        d = int(self.rng.integers(t.ndim))
        ids = self.rng.integers(-t.shape[d], t.shape[d], size=int(self.rng.integers(1, 5)))
        key = [slice(None)] * t.ndim
        key[d] = ids
        if t.ndim >= 2:
            e = (d + 1) % t.ndim
            key[e] = snp.astype(snp.abs(snp.sum(t)) * 3.0, "int64") + np.arange(len(ids))
        return t[tuple(key)]

    def at_update(self, t):
        """x.at[ids].set / add / min / max / multiply on one dim, constant ids with repeats, values a fresh input."""
        if t.ndim == 0:
            return None
        d = int(self.rng.integers(t.ndim))
        ids = self.rng.integers(-t.shape[d], t.shape[d], size=int(self.rng.integers(1, 5)))
        key = (slice(None),) * d + (ids,)
        u = snp.tanh(self.new_param(t.shape[:d] + ids.shape + t.shape[d + 1:]))
        kind = ("set", "add", "min", "max", "multiply")[self.rng.integers(5)]
        return getattr(t.at[key], kind)(u)

    def cumsum(self, t):
        return snp.tanh(snp.cumsum(t, axis=int(self.rng.integers(t.ndim)))) if t.ndim else None

    def arg_reduce(self, t):
        if t.ndim == 0:
            return None
        fn = snp.argmax if self.rng.random() < 0.5 else snp.argmin
        return snp.astype(fn(t, axis=int(self.rng.integers(t.ndim))), "float64") * 0.1

    def top_k(self, t):
        """The k largest along the last axis (values and indices joined back into one float tensor)."""
        if t.ndim == 0:
            return None
        k = int(self.rng.integers(1, t.shape[-1] + 1))
        values, indices = snp.top_k(t, k)
        return snp.tanh(values) + snp.astype(indices, "float64") * 0.01

    def special_random(self, t):
        """erf / erfc of a pool tensor, or it times uniform noise, or dropped out (ops/special.py, ops/random.py:
        random bits follow the tensor's layout, and must be the global array's on every mesh)."""
        kind = int(self.rng.integers(3))
        if kind == 0:
            return snp.erf(t) + snp.erfc(t * 0.5)
        key = srandom.key(int(self.rng.integers(2 ** 31)))
        if kind == 1:
            return t * srandom.uniform(key, t.shape, t.dtype, -1.0, 1.0)
        return snn.dropout(key, t, 0.3)

    def injected_gradient(self, t):
        """The gradient of a sum through with_gradients (ops/core.py) that gives t, beside its own derivative,
        another pool tensor of its shape as a gradient: no instruction of its own, on any layout."""
        others = [o for o in self.pool if o.shape == t.shape]
        given = others[self.rng.integers(len(others))]
        return sr.grad(lambda a: with_gradients(snp.sum(snp.tanh(a)), [a], [given]))(t)

    def logsumexp(self, t):
        return snp.tanh(snp.logsumexp(t, axis=int(self.rng.integers(t.ndim)))) if t.ndim else None

    def pooling(self, t):
        """Max or average pooling along one dim, window 2 or 3, 'SAME' padding or stride 2."""
        if t.ndim == 0:
            return None
        d, k = int(self.rng.integers(t.ndim)), int(self.rng.integers(2, 4))
        window = tuple(k if i == d else 1 for i in range(t.ndim))
        if k > t.shape[d]:
            return None
        strides = tuple(2 if i == d and self.rng.random() < 0.5 else 1 for i in range(t.ndim))
        return snp.reduce_window(t, "max" if self.rng.random() < 0.5 else "avg", window, strides, "SAME")

    def conv1d(self, t):
        """(N, C, W) convolution with a fresh (O, C, K) kernel, 'SAME' padding."""
        if t.ndim != 3 or t.shape[2] < 3:
            return None
        k = self.new_param((int(self.rng.integers(1, 4)), t.shape[1], 3))
        return snp.tanh(snp.conv(t, k, (1,), "SAME"))

    def slice_(self, t):
        """Basic indexing: a random start/stop/step (negative steps too) on one dim."""
        if t.ndim == 0:
            return None
        d = int(self.rng.integers(t.ndim))
        n = t.shape[d]
        start, stop = sorted(self.rng.integers(0, n + 1, size=2).tolist())
        step = [1, 1, 2, -1][self.rng.integers(4)]
        if start == stop:
            return None
        index = [slice(None)] * t.ndim
        index[d] = slice(start, stop, step) if step > 0 else slice(stop - 1, None if start == 0 else start - 1, step)
        return t[tuple(index)]

    def flip(self, t):
        return snp.flip(t, axis=int(self.rng.integers(t.ndim))) if t.ndim else None

    def pad(self, t):
        if t.ndim == 0:
            return None
        widths = [(0, 0)] * t.ndim
        widths[int(self.rng.integers(t.ndim))] = tuple(self.rng.integers(0, 3, size=2).tolist())
        return snp.pad(t, widths)

    def concat(self, t):
        if t.ndim == 0:
            return None
        return snp.concatenate([t, t * 0.5], axis=int(self.rng.integers(t.ndim)))

    def roll(self, t):
        """np.roll by a random shift along one dim (two slices and a concatenation), the dim split as the
        operand's: rows change owners across shard boundaries."""
        if t.ndim == 0:
            return None
        d = int(self.rng.integers(t.ndim))
        n = t.shape[d]
        if n < 2:
            return None
        s = int(self.rng.integers(1, n))
        head = tuple(slice(n - s, n) if e == d else slice(None) for e in range(t.ndim))
        tail = tuple(slice(0, n - s) if e == d else slice(None) for e in range(t.ndim))
        return snp.concatenate([t[head], t[tail]], axis=d)

    def split_slice(self, t):
        """A (strided) slice of a dim annotated split, result annotated split the same way: the exchange path."""
        if t.ndim == 0:
            return None
        d = int(self.rng.integers(t.ndim))
        n = t.shape[d]
        start = int(self.rng.integers(0, n))
        stop = int(self.rng.integers(start + 1, n + 1))
        axis = self.mesh.axis_names[int(self.rng.integers(len(self.mesh.axis_names)))]
        spec = tuple(axis if e == d else None for e in range(t.ndim))
        index = tuple(slice(start, stop, int(self.rng.integers(1, 4))) if e == d else slice(None)
                      for e in range(t.ndim))
        return sr.mesh_split(sr.mesh_split(t, self.mesh, spec)[index], self.mesh, spec)

    def split_spec(self, ndim, d):
        """Dim d split over a random mesh axis, the others replicated."""
        axis = self.mesh.axis_names[int(self.rng.integers(len(self.mesh.axis_names)))]
        return tuple(axis if e == d else None for e in range(ndim))

    def numpy_family(self, t):
        """One of the issue-28 functions with an op or reduction kind of their own (one slot of the op list):
        sort / argsort, take_along_axis, prod, any / all."""
        ops = [self.sort, self.take_along_axis, self.prod, self.any_all]
        return ops[self.rng.integers(len(ops))](t)

    def sort(self, t):
        """sort (maybe descending) or argsort along a random dim, whatever its split."""
        if t.ndim == 0:
            return None
        axis, descending = int(self.rng.integers(t.ndim)), bool(self.rng.random() < 0.5)
        if self.rng.random() < 0.5:
            return snp.sort(t, axis=axis, descending=descending)
        return snp.astype(snp.argsort(t, axis=axis, descending=descending), "float64") * 0.1

    def take_along_axis(self, t):
        """Entries of t picked along one dim by the argsort of a fresh input (negative positions too)."""
        if t.ndim == 0:
            return None
        axis = int(self.rng.integers(t.ndim))
        shape = t.shape[:axis] + (SIZES[self.rng.integers(len(SIZES))],) + t.shape[axis + 1:]
        order = snp.argsort(self.new_param(shape), axis=axis)
        return snp.take_along_axis(t, snp.minimum(order, t.shape[axis] - 1) - t.shape[axis], axis=axis)

    def prod(self, t):
        """A product over random dims of values near 1 (tanh keeps them in (0.5, 1.5))."""
        if t.ndim == 0:
            return None
        axes = tuple(sorted(set(self.rng.integers(t.ndim, size=self.rng.integers(1, t.ndim + 1)).tolist())))
        return snp.prod(1.0 + 0.5 * snp.tanh(t), axis=axes, keepdims=bool(self.rng.random() < 0.3))

    def any_all(self, t):
        if t.ndim == 0:
            return None
        axis = int(self.rng.integers(t.ndim))
        fn = snp.any if self.rng.random() < 0.5 else snp.all
        return snp.where(fn(t > 0.0, axis=axis, keepdims=True), t, -t)

    def split_family(self, t):
        """One of the ops below on a dim annotated split (one slot of the op list, so the mix stays as it was)."""
        ops = [self.split_roll, self.split_pool, self.split_reshape, self.split_kernel_grad, self.split_interior_pad,
               self.split_update, self.split_pool_grad]
        return ops[self.rng.integers(len(ops))](t)

    def split_roll(self, t):
        """snp.roll along a dim annotated split, the result split alike: a rotation of the blocks."""
        if t.ndim == 0:
            return None
        d = int(self.rng.integers(t.ndim))
        spec = self.split_spec(t.ndim, d)
        shift = int(self.rng.integers(-2 * t.shape[d], 2 * t.shape[d] + 1))
        return sr.mesh_split(snp.roll(sr.mesh_split(t, self.mesh, spec), shift, d), self.mesh, spec)

    def split_pool(self, t):
        """A wide window (up to 7, maybe strided, asymmetric padding) along a split dim: multi-hop halos."""
        if t.ndim == 0:
            return None
        d = int(self.rng.integers(t.ndim))
        k, stride = int(self.rng.integers(2, 8)), int(self.rng.integers(1, 3))
        low, high = (int(v) for v in self.rng.integers(0, k, size=2))
        if (t.shape[d] + low + high - k) < 0:
            return None
        window = tuple(k if e == d else 1 for e in range(t.ndim))
        strides = tuple(stride if e == d else 1 for e in range(t.ndim))
        padding = tuple((low, high) if e == d else (0, 0) for e in range(t.ndim))
        kind = ["max", "sum", "avg"][self.rng.integers(3)]
        x = sr.mesh_split(t, self.mesh, self.split_spec(t.ndim, d))
        return snp.tanh(snp.reduce_window(x, kind, window, strides, padding))

    def split_pool_grad(self, t):
        """The gradient of a max or min pool along a split dim (window_select, window_scatter: halo exchanges of
        the input, then of the cotangents and chosen taps), window up to 5, maybe strided past it."""
        if t.ndim == 0:
            return None
        d = int(self.rng.integers(t.ndim))
        k, stride = int(self.rng.integers(2, 6)), int(self.rng.integers(1, 4))
        low, high = (int(v) for v in self.rng.integers(0, k, size=2))
        if t.shape[d] + low + high - k < 0:
            return None
        window = tuple(k if e == d else 1 for e in range(t.ndim))
        strides = tuple(stride if e == d else 1 for e in range(t.ndim))
        padding = tuple((low, high) if e == d else (0, 0) for e in range(t.ndim))
        kind, spec = "max" if self.rng.random() < 0.5 else "min", self.split_spec(t.ndim, d)
        grad = sr.grad(lambda a: snp.sum(snp.reduce_window(a, kind, window, strides, padding) ** 2))
        return sr.mesh_split(snp.tanh(grad(sr.mesh_split(t, self.mesh, spec))), self.mesh, spec)

    def split_reshape(self, t):
        """Merge a split dim with the next one (or split a split dim in two), the result split on its major
        dim: shard boundaries rarely align."""
        if t.ndim >= 2 and self.rng.random() < 0.5:
            i = int(self.rng.integers(t.ndim - 1))
            shape = t.shape[:i] + (t.shape[i] * t.shape[i + 1],) + t.shape[i + 2:]
            x, out = sr.mesh_split(t, self.mesh, self.split_spec(t.ndim, i)), self.split_spec(len(shape), i)
            return sr.mesh_split(x.reshape(shape), self.mesh, out)
        splittable = [i for i, n in enumerate(t.shape) if n in (4, 6, 8, 10, 12)]
        if not splittable or t.ndim >= 4:
            return None
        i = splittable[self.rng.integers(len(splittable))]
        shape = t.shape[:i] + (2, t.shape[i] // 2) + t.shape[i + 1:] if self.rng.random() < 0.5 else \
            t.shape[:i] + (t.shape[i] // 2, 2) + t.shape[i + 1:]
        x, out = sr.mesh_split(t, self.mesh, self.split_spec(t.ndim, i)), self.split_spec(len(shape), i)
        return sr.mesh_split(x.reshape(shape), self.mesh, out)

    def split_kernel_grad(self, t):
        """(N, C, W) convolved with a fresh (O, C, K) kernel as wide as most of W, both split on the spatial dim
        (the kernel-gradient convolution): a local conv, then a reduction of the partial output."""
        if t.ndim != 3 or t.shape[2] < 2:
            return None
        low, high = (int(v) for v in self.rng.integers(0, 3, size=2))
        taps = int(self.rng.integers(max(1, t.shape[2] - 3), t.shape[2] + low + high + 1))
        g = self.new_param((int(self.rng.integers(1, 4)), t.shape[1], taps))
        spec = self.split_spec(3, 2)
        x, g = sr.mesh_split(t, self.mesh, spec), sr.mesh_split(g, self.mesh, spec)
        return snp.tanh(snp.conv(x, g, 1, ((low, high),)))

    def split_interior_pad(self, t):
        """Interior (and edge) padding along a split dim, the result split alike."""
        if t.ndim == 0:
            return None
        d = int(self.rng.integers(t.ndim))
        config = [(0, 0, 0)] * t.ndim
        config[d] = (int(self.rng.integers(-1, 3)), int(self.rng.integers(-1, 3)), int(self.rng.integers(1, 3)))
        if t.shape[d] + config[d][0] + config[d][1] + (t.shape[d] - 1) * config[d][2] < 1:
            return None
        spec = self.split_spec(t.ndim, d)
        return sr.mesh_split(snp.lax_pad(sr.mesh_split(t, self.mesh, spec), 0.5, config), self.mesh, spec)

    def split_update(self, t):
        """dynamic_update_slice at a static start (clamped) of a fresh update split along the same dim."""
        if t.ndim == 0:
            return None
        d = int(self.rng.integers(t.ndim))
        size = int(self.rng.integers(1, t.shape[d] + 1))
        u = self.new_param(tuple(size if e == d else n for e, n in enumerate(t.shape)))
        spec = self.split_spec(t.ndim, d)
        start = [int(self.rng.integers(-1, t.shape[d] + 1)) if e == d else 0 for e in range(t.ndim)]
        update = sr.mesh_split(snp.tanh(u), self.mesh, spec)
        return sr.mesh_split(snp.dynamic_update_slice(sr.mesh_split(t, self.mesh, spec), update, start), self.mesh,
                             spec)

    def dynamic_slice(self, t):
        """A window at a traced start (from data), clamped globally."""
        if t.ndim == 0:
            return None
        d = int(self.rng.integers(t.ndim))
        size = int(self.rng.integers(1, t.shape[d] + 1))
        start = snp.astype(snp.abs(snp.sum(t)) * 3.0, "int64")
        starts = [start if i == d else 0 for i in range(t.ndim)]
        return snp.dynamic_slice(t, starts, [size if i == d else n for i, n in enumerate(t.shape)])

    def scan_(self, t):
        """A scan over ``t``'s leading dim from carries (c, d) of a slice's shape, with a body from
        ``SCAN_BODIES``; the final carries and the stacked ys join the pool."""
        if t.ndim == 0:
            return None
        init = (snp.tanh(snp.sum(t, axis=0)), snp.tanh(snp.max(t, axis=0)))
        body = SCAN_BODIES[self.rng.integers(len(SCAN_BODIES))]
        (c, d), ys = sr.scan(body, init, t, reverse=bool(self.rng.random() < 0.3))
        self.pool += [c, d]
        return ys

    def while_(self, t):
        """``t`` updated 0 to 3 times by a while loop (its body writes the carry in place: the loop's copy,
        not ``t``, which stays in the pool)."""
        trips = int(self.rng.integers(4))
        start = snp.astype(snp.sum(t) * 0.0, "int32")
        return sr.while_loop(lambda c: c[0] < trips, lambda c: (c[0] + 1, snp.tanh(c[1] * 0.5 + t)), (start, t))[1]

    def new_param(self, shape):
        self.extra_shapes.append(shape)
        return self.extra[len(self.extra_shapes) - 1]


def _shared(s):
    return (s, s), s


# Scan bodies (carries (c, d), slice x) -> ((c', d'), y): each carry made by the body (updated in place), handed
# on as it is, taken from xs, swapped, or one buffer for both carries and y (neither in place).
SCAN_BODIES = [
    lambda cd, x: ((snp.tanh(cd[0] + x), cd[1] * 0.5 + x), cd[0] * x),
    lambda cd, x: ((cd[0], snp.tanh(cd[1] - x)), x + cd[0]),
    lambda cd, x: ((x, snp.tanh(cd[0] * cd[1])), cd[1]),
    lambda cd, x: ((cd[1], cd[0]), snp.tanh(x)),
    lambda cd, x: _shared(snp.tanh(cd[0] + cd[1] + x)),
]


def random_case(seed: int, max_devices: int = 8, steps=(3, 9), devices=None, loops=False) -> FuzzCase:
    """A random program, mesh and shardings; deterministic in ``seed`` (and ``devices``, the exact mesh size,
    and ``loops``: one or two loops at the end)."""
    rng = np.random.default_rng(seed)
    mesh = random_mesh(rng, max_devices, devices)
    n_in = int(rng.integers(1, 3))
    shapes = [tuple(SIZES[i] for i in rng.integers(len(SIZES), size=rng.integers(1, 4))) for _ in range(n_in)]
    n_steps = int(rng.integers(*steps))
    extra_shapes = _extra_shapes(seed, mesh, shapes, n_steps)
    all_shapes = shapes + extra_shapes
    fn = _program(seed, mesh, n_in, n_steps, loops)
    graph = sr.trace(fn, *[sr.TensorSpec(s, "float64") for s in all_shapes])
    spec_rng = np.random.default_rng(seed + 1_000_003)
    in_specs = [random_sharding(spec_rng, mesh, len(s)) if spec_rng.random() < 0.7 else None for s in all_shapes]
    out_specs = [random_sharding(spec_rng, mesh, len(graph[o].shape)) if spec_rng.random() < 0.5 else None
                 for o in graph.outputs]
    data_rng = np.random.default_rng(seed + 2_000_003)
    inputs = [data_rng.standard_normal(s) for s in all_shapes]
    return FuzzCase(seed, mesh, graph, inputs, in_specs, out_specs)


def _program(seed, mesh, n_in, n_steps, loops=False):
    """The traced function: replays the same random choices on whatever tensors it receives."""
    def fn(*args):
        rng = np.random.default_rng(seed + 17)
        b = _Builder(rng, mesh, {i: a for i, a in enumerate(args[:n_in])})
        b.extra = list(args[n_in:])
        for _ in range(n_steps):
            b.step()
        for _ in range(int(rng.integers(1, 3)) if loops else 0):
            out = (b.scan_, b.while_)[rng.integers(2)](b.pick())
            b.pool += [out] if out is not None else []
        outs = b.pool[n_in:] or b.pool
        return outs[-1], outs[int(rng.integers(len(outs)))]
    return fn


def _extra_shapes(seed, mesh, shapes, n_steps):
    """Dry-run the builder once to learn the shapes of the fresh einsum operands it asks for."""
    extra: list = []

    class _Collect(list):
        def __getitem__(self, i):
            return snp.zeros(extra[i]) * 1.0

    def fn(*args):
        rng = np.random.default_rng(seed + 17)
        b = _Builder(rng, mesh, {i: a for i, a in enumerate(args)})
        b.extra_shapes = extra
        b.extra = _Collect()
        for _ in range(n_steps):
            b.step()
        return b.pool[-1]
    sr.trace(fn, *[sr.TensorSpec(s, "float64") for s in shapes])
    return list(extra)


def check_case(case: FuzzCase, run, **partition_options):
    """Partition ``case`` (with ``partition_options``) and compare ``run(program, inputs)`` (global outputs)
    with the reference; returns the program."""
    program = sr.partition(case.graph, case.mesh, in_specs=case.in_specs, out_specs=case.out_specs,
                           **partition_options)
    want = sr.evaluate(case.graph, *case.inputs)
    got = run(program, case.inputs)
    for g, w in zip(got, want):
        assert g.shape == w.shape, f"{case}\nshape {g.shape} != {w.shape}"
        np.testing.assert_allclose(to_host(g), w, rtol=1e-9, atol=1e-9, err_msg=str(case))
    return program
