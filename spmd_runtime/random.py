"""Random numbers: ``import spmd_runtime.random as srandom`` (``jax.random``'s names and semantics).

Keys are counter-based (Threefry-2x32, as JAX): a key is a uint32 array of shape (2,), ``key(seed)``, and
new keys come from ``split(key, num)`` and ``fold_in(key, data)``, never from state. Samplers hash the
global index of every entry under the key (``ops/random.py``), so a random array is the same on 1 rank or
8, whatever its sharding (JAX's ``jax_threefry_partitionable=True``, the default since JAX 0.5), and each rank
computes only its own block: a dropout mask sharded like the activations costs no communication.

The bits are JAX's with ``jax_threefry_partitionable``: ``key``, ``split``, ``fold_in`` and ``bits`` give
JAX's values bit for bit (``tests/unit/test_random.py`` checks the Threefry vectors of the Random123 paper
and JAX's documented ``split(key(0))``), and ``uniform`` the same floats; ``normal`` and what uses erfinv
may differ from JAX's in the last float32 bit (its erf_inv is a float32 polynomial, ours the float64 one
rounded once, ``ops/special.py``).

Keys work on NumPy arrays outside a trace (``key``, ``split``, ``fold_in`` compute at once) and on traced
uint32 tensors inside one (a key passed to a ``jit`` function, replicated). Samplers run inside a trace
(``sr.jit``, ``sr.trace``), and outside one eagerly, as ``snp``'s functions do (``spmd_runtime/eager.py``: one
cached program per call signature, a replicated DArray on the context mesh). Keys are raw uint32 arrays (``jax.random.PRNGKey``'s form); ``key`` returns the
same (no typed key arrays), ``key_data`` / ``wrap_key_data`` are the identity.
"""
from __future__ import annotations

import math

import numpy as np

from .dtypes import finfo
from .ops import core
from .ops.indexing import argmax
from .ops.random import (BIT_WIDTHS, KEY_DTYPE, MANTISSA_BITS, THREEFRY, check_key, random_bits, random_int,
                         static_shape, threefry2x32, unit_float)
from .ops.slicing import arange, concatenate
from .ops.special import erf, erfinv
from .ops.top_k import top_k
from .ops.gather import take
from . import dispatch
from .trace import Tensor

__all__ = ["key", "PRNGKey", "key_data", "wrap_key_data", "split", "fold_in", "bits", "uniform", "normal",
           "truncated_normal", "bernoulli", "categorical", "gumbel", "randint", "permutation"]

_WORD = 2 ** 32


# ================================================================ keys
def key(seed) -> np.ndarray | Tensor:
    """The key of an integer ``seed``: [seed >> 32, seed & 0xFFFFFFFF] as uint32 (JAX's ``PRNGKey``: key(0)
    is [0, 0], key(42) is [0, 42]). A traced 32-bit integer seed gives a traced key [0, seed]."""
    if isinstance(seed, Tensor):
        if seed.ndim != 0 or seed.dtype.kind not in "iu" or seed.dtype.itemsize > 4:
            raise ValueError(f"a traced seed is a 0-d integer of at most 32 bits (a wider one: pass it as a Python "
                             f"int); got {seed.dtype}{list(seed.shape)}")
        low = core.reshape(core.astype(seed, KEY_DTYPE), (1,))
        return concatenate([core.zeros((1,), KEY_DTYPE), low])
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) or not (
            -2 ** 63 <= int(seed) < 2 ** 64):
        raise ValueError(f"a seed is an integer in [-2^63, 2^64); got {seed!r}")
    seed = int(seed) % 2 ** 64
    return np.array([seed >> 32, seed & (_WORD - 1)], dtype=KEY_DTYPE)


PRNGKey = key


def key_data(k):
    """The key's uint32 words: keys here are already raw (2,) uint32 arrays."""
    return k


wrap_key_data = key_data


def split(k, num: int = 2):
    """``num`` new keys (shape (num, 2)): the hash of the counts (0, i) under ``k`` (JAX's partitionable split)."""
    if isinstance(num, Tensor) or not isinstance(num, (int, np.integer)) or num < 0:
        raise ValueError(f"split makes a static number of keys (a non-negative Python int); got num={num!r}")
    index = np.arange(int(num), dtype=np.uint64)
    counts = np.stack([(index >> np.uint64(32)).astype(KEY_DTYPE), index.astype(KEY_DTYPE)], axis=-1)
    return _hash(k, counts)


def fold_in(k, data):
    """A new key from ``k`` and an integer ``data`` (a step number, a rank...): the hash of (0, data)."""
    if isinstance(data, Tensor):
        if data.ndim != 0 or data.dtype.kind not in "iu" or data.dtype.itemsize > 4:
            raise ValueError(f"fold_in takes a 0-d integer of at most 32 bits; got {data.dtype}{list(data.shape)}")
        counts = concatenate([core.zeros((1,), KEY_DTYPE), core.reshape(core.astype(data, KEY_DTYPE), (1,))])
        return _hash(k, counts)
    if not isinstance(data, (int, np.integer)) or isinstance(data, (bool, np.bool_)):
        raise ValueError(f"fold_in takes an integer; got {data!r}")
    return _hash(k, np.array([0, int(data) % _WORD], dtype=KEY_DTYPE))


def _hash(k, counts):
    """threefry2x32 of ``counts`` under ``k``: computed now on NumPy values, traced when either is a tensor."""
    if isinstance(k, Tensor) or isinstance(counts, Tensor):
        return threefry2x32(k, counts)
    return THREEFRY.kernel(np, check_key(k), counts)


# ================================================================ samplers
def bits(k, shape=(), dtype="uint32") -> Tensor:
    """Uniform random unsigned integers of ``dtype`` (uint8/16/32/64)."""
    dtype = np.dtype(dtype)
    width = 8 * dtype.itemsize
    if dtype.kind != "u" or BIT_WIDTHS.get(width) != dtype.name:
        raise ValueError(f"bits draws an unsigned dtype ({', '.join(BIT_WIDTHS.values())}); got {dtype}")
    return random_bits(k, shape, width)


def uniform(k, shape=(), dtype="float32", minval=0.0, maxval=1.0) -> Tensor:
    """Floats uniform in [minval, maxval) (JAX's: the top mantissa bits of random bits as wide as ``dtype``,
    scaled in ``dtype``, then max with minval)."""
    dtype = _float_dtype(dtype, "uniform")
    u = unit_float(random_bits(k, shape, 8 * dtype.itemsize), dtype)
    if _is_static(minval) and _is_static(maxval):
        lo, hi = np.asarray(minval, dtype), np.asarray(maxval, dtype)
        if float(lo) == 0.0 and float(hi) == 1.0:
            return u  # u * 1 + 0 and max(0, u) are u itself
        span = float(hi - lo)  # rounded in dtype, as JAX subtracts the converted bounds; a weak scalar after
        return core.maximum(u * span + float(lo), float(lo))
    lo, hi = core.astype(core.asarray(minval), dtype), core.astype(core.asarray(maxval), dtype)
    return core.maximum(u * (hi - lo) + lo, lo)


def normal(k, shape=(), dtype="float32") -> Tensor:
    """Standard normal floats: sqrt(2) erfinv(u) for u uniform in (-1, 1) (JAX's method)."""
    dtype = _float_dtype(dtype, "normal")
    lo = float(np.nextafter(np.asarray(-1.0, dtype), np.asarray(0.0, dtype)))
    return erfinv(uniform(k, shape, dtype, lo, 1.0)) * math.sqrt(2.0)


def truncated_normal(k, lower, upper, shape=None, dtype="float32") -> Tensor:
    """Standard normal floats conditioned on (lower, upper) (static bounds): inverse-CDF sampling between
    erf(lower / sqrt 2) and erf(upper / sqrt 2), clipped into the open interval (JAX's method)."""
    dtype = _float_dtype(dtype, "truncated_normal")
    if not (_is_static(lower) and _is_static(upper)):
        raise ValueError(f"truncated_normal takes static bounds (Python or NumPy numbers); got lower={lower!r}, "
                         f"upper={upper!r}")
    lower, upper = np.asarray(lower, dtype), np.asarray(upper, dtype)
    shape = np.broadcast_shapes(lower.shape, upper.shape) if shape is None else static_shape(shape, "samplers")
    sqrt2 = math.sqrt(2.0)
    a, b = erf(core.asarray(lower) / sqrt2), erf(core.asarray(upper) / sqrt2)
    out = erfinv(uniform(k, shape, dtype, a, b)) * sqrt2
    low, high = np.nextafter(lower, np.asarray(np.inf, dtype)), np.nextafter(upper, np.asarray(-np.inf, dtype))
    return core.minimum(core.maximum(out, core.asarray(low)), core.asarray(high))


def bernoulli(k, p=0.5, shape=None) -> Tensor:
    """Booleans, True with probability ``p`` (a float or a float tensor; shape: ``p``'s by default):
    uniform(k, shape, p's dtype) < p (JAX's)."""
    p_shape = tuple(p.shape) if hasattr(p, "shape") else ()
    dtype = p.dtype if hasattr(p, "dtype") else np.dtype("float32")
    if np.dtype(dtype).kind != "f":
        raise ValueError(f"bernoulli takes a floating probability p; got dtype {dtype}")
    shape = p_shape if shape is None else static_shape(shape, "samplers")
    if np.broadcast_shapes(p_shape, shape) != shape:
        raise ValueError(f"bernoulli's p must broadcast to shape {shape}; got p of shape {p_shape}")
    return core.less(uniform(k, shape, dtype), p)


def gumbel(k, shape=(), dtype="float32") -> Tensor:
    """Standard Gumbel floats: -log(-log(u)), u uniform in [tiny, 1)."""
    dtype = _float_dtype(dtype, "gumbel")
    return -core.log(-core.log(uniform(k, shape, dtype, float(finfo(dtype).tiny), 1.0)))


def categorical(k, logits, axis=-1, shape=None) -> Tensor:
    """Indices drawn with probabilities softmax(logits) along ``axis`` (the Gumbel-max trick, as JAX); int32.
    ``shape``: the result's, whose trailing dims are the batch dims of logits."""
    logits = core.asarray(logits)
    axis = core.normalize_axis(axis, logits.ndim)
    batch = logits.shape[:axis] + logits.shape[axis + 1:]
    shape = batch if shape is None else static_shape(shape, "samplers")
    if len(shape) < len(batch) or shape[len(shape) - len(batch):] != batch:
        raise ValueError(f"categorical's shape must end with the batch dims of logits {batch}; got {shape}")
    prefix = shape[:len(shape) - len(batch)]
    noise_axis = len(prefix) + axis
    noisy = gumbel(k, prefix + logits.shape, logits.dtype) + logits
    return core.astype(argmax(noisy, axis=noise_axis), "int32")


def randint(k, shape, minval, maxval, dtype="int32") -> Tensor:
    """Integers uniform in [minval, maxval) (static ints; JAX's algorithm: twice the bits of ``dtype``, from
    the two keys of split(k), folded mod the span). maxval <= minval gives minval; maxval may exceed the
    dtype's range by one (randint(k, s, 0, 256, 'uint8'))."""
    dtype = np.dtype(dtype)
    if dtype.kind not in "iu" or 8 * dtype.itemsize not in BIT_WIDTHS:
        raise ValueError(f"randint draws an integer dtype; got {dtype}")
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in (minval, maxval)):
        raise ValueError(f"randint takes static integer bounds; got minval={minval!r}, maxval={maxval!r}")
    info = np.iinfo(dtype)
    lo = min(max(int(minval), info.min), info.max)
    hi = min(max(int(maxval), info.min), info.max + 1)
    keys = split(k)
    width = 8 * dtype.itemsize
    higher, lower = random_bits(keys[0], shape, width), random_bits(keys[1], shape, width)
    return random_int(higher, lower, lo, max(hi - lo, 1), dtype)


def permutation(k, x, axis=0, independent=False) -> Tensor:
    """A random permutation of ``arange(x)`` (an int) or of ``x`` along ``axis`` (JAX's: rounds of sorting by
    random 32-bit keys, enough rounds that ties are unlikely; the sort here is a stable top_k)."""
    if independent:
        raise NotImplementedError("permutation(independent=True) (each slice shuffled on its own) is not "
                                  "implemented; got independent=True: use independent=False")
    if isinstance(x, (int, np.integer)):
        return _shuffled_positions(k, int(x))
    x = core.asarray(x)
    axis = core.normalize_axis(axis, x.ndim)
    return take(x, _shuffled_positions(k, x.shape[axis]), axis=axis)


def _shuffled_positions(k, n: int) -> Tensor:
    positions = arange(n, dtype="int32")
    rounds = math.ceil(3 * math.log(max(1, n)) / math.log(_WORD - 1))
    for _ in range(rounds):
        k, sub = split(k)
        sort_keys = random_bits(sub, (n,))
        _, order = top_k(np.uint32(_WORD - 1) - sort_keys, n)  # descending complement: a stable ascending sort
        positions = take(positions, order)
    return positions


# ================================================================ helpers
def _float_dtype(dtype, what: str) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype.name not in MANTISSA_BITS:
        raise ValueError(f"{what} draws a floating dtype ({', '.join(MANTISSA_BITS)}); got {dtype}")
    return dtype


def _is_static(v) -> bool:
    return not isinstance(v, Tensor) and np.ndim(v) == 0


SAMPLERS = ("bits", "uniform", "normal", "truncated_normal", "bernoulli", "gumbel", "categorical", "randint",
            "permutation")
dispatch.wrap_functions(globals(), SAMPLERS)  # eager outside a trace, as snp
