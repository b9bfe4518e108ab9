"""Random family: counter-based random bits (Threefry-2x32, 20 rounds; Salmon et al., "Parallel random numbers:
as easy as 1, 2, 3", SC 2011), the ops under ``spmd_runtime.random``.

Partitionable by construction (JAX's ``jax_threefry_partitionable`` semantics): the bits at global index i of
a ``random_bits(key, shape)`` array are ``y0 ^ y1`` with ``(y0, y1) = threefry2x32(key, (hi(i), lo(i)))``,
i the row-major linear index as 64 bits split into two 32-bit words. Each rank hashes only the indices of
its own block, so the global array is the same on any mesh and under any sharding, and no data moves.

Records (one kernel each, written against ``xp``; NumPy uint32 arithmetic wraps modulo 2^32):

- ``random_bits``: key (uint32 (2,)) [, shard numbers] -> uint8/16/32/64 bits of a static shape (8 and 16
  bits: the low bits of the 32; 64: ``y0 << 32 | y1``, as JAX). Partitioned, its kernel learns the block's
  global offset from one shard-number operand per split dim (``split``, ``blocks``), as ``iota`` does.
- ``threefry2x32``: key, counts (..., 2) -> (..., 2): the hash of each count pair (keys' ``split``, ``fold_in``).
- ``random_unit``: uintN bits -> floatN in [0, 1) (the top mantissa bits under the exponent of 1.0, minus 1).
- ``random_int``: two bit arrays -> integers in [minval, minval + span) (JAX's ``randint``: the higher bits
  times 2^(n) mod span plus the lower bits, mod span).

None has a gradient (``autodiff/rules/random.py``); the partition rules are in ``partition/rules/random.py``.
"""
from __future__ import annotations

import math

import numpy as np

from .. import opdef
from ..opdef import define
from ..trace import Tensor, emit
from . import core

RANDOM_BITS = define("random_bits", fresh=True)
THREEFRY = define("threefry2x32", fresh=True)
RANDOM_UNIT = define("random_unit", fresh=True)
RANDOM_INT = define("random_int", fresh=True)
RANDOM_OPS = (RANDOM_BITS, THREEFRY, RANDOM_UNIT, RANDOM_INT)
BIT_WIDTHS = {8: "uint8", 16: "uint16", 32: "uint32", 64: "uint64"}
MANTISSA_BITS = {"float16": 10, "bfloat16": 7, "float32": 23, "float64": 52}  # the floats random_unit makes
KEY_SHAPE, KEY_DTYPE = (2,), np.dtype("uint32")


# ================================================================ traced API
def check_key(key):
    """``key`` (a traced tensor, or an array as NumPy), checked to be a uint32 array of shape (2,)."""
    if not isinstance(key, Tensor):
        key = np.asarray(key)
    shape, dtype = tuple(key.shape), np.dtype(key.dtype)
    if shape != KEY_SHAPE or dtype != KEY_DTYPE:
        raise ValueError(f"a random key is a uint32 array of shape (2,) (sr.random.key(seed), or one row of "
                         f"sr.random.split); got shape {shape}, dtype {dtype}")
    return key


def key_tensor(key) -> Tensor:
    """``key`` as a traced uint32 (2,) tensor (an array becomes a constant); refuses anything else."""
    return core.asarray(check_key(key))


def random_bits(key, shape, width: int = 32) -> Tensor:
    """The ``width``-bit random bits of a static ``shape`` under ``key`` (see the module docstring)."""
    shape = static_shape(shape, "random bits")
    if width not in BIT_WIDTHS:
        raise ValueError(f"random bits come in widths {sorted(BIT_WIDTHS)}; got {width!r}")
    attrs = {"shape": shape, "global_shape": shape, "width": int(width), "split": (), "blocks": ()}
    return emit(RANDOM_BITS, [key_tensor(key)], attrs, shape, BIT_WIDTHS[width])


def threefry2x32(key, counts) -> Tensor:
    """The Threefry-2x32 hash under ``key`` of each pair ``counts[..., :]`` (uint32, last dim 2)."""
    counts = core.asarray(counts)
    if counts.ndim == 0 or counts.shape[-1] != 2 or counts.dtype != KEY_DTYPE:
        raise ValueError(f"threefry2x32 hashes uint32 pairs: counts of shape (..., 2); got shape {counts.shape}, "
                         f"dtype {counts.dtype}")
    return emit(THREEFRY, [key_tensor(key), counts], {}, counts.shape, KEY_DTYPE)


def unit_float(bits, dtype) -> Tensor:
    """Floats in [0, 1) of ``dtype`` from random bits of the same width (JAX's uniform: the top mantissa bits)."""
    bits, dtype = core.asarray(bits), np.dtype(dtype)
    if dtype.name not in MANTISSA_BITS or bits.dtype != np.dtype(BIT_WIDTHS[8 * dtype.itemsize]):
        raise ValueError(f"unit_float needs unsigned bits as wide as the float dtype; got {bits.dtype} bits for "
                         f"{dtype}")
    return emit(RANDOM_UNIT, [bits], {"dtype": dtype.name}, bits.shape, dtype)


def random_int(higher, lower, minval: int, span: int, dtype) -> Tensor:
    """minval + (higher mod span * multiplier + lower mod span) mod span in n-bit unsigned arithmetic, where
    multiplier = (2^(n/2) mod span)^2 mod 2^n mod span (JAX's randint); span 2^n: the lower bits."""
    higher, lower, dtype = core.asarray(higher), core.asarray(lower), np.dtype(dtype)
    nbits = 8 * dtype.itemsize
    if not 1 <= span <= 2 ** nbits:
        raise ValueError(f"random_int draws from 1 <= span <= 2^{nbits} values; got span {span}")
    half = 2 ** (nbits // 2) % span
    multiplier = half * half % 2 ** nbits % span
    attrs = {"minval": int(minval), "span": int(span), "multiplier": int(multiplier), "dtype": dtype.name}
    return emit(RANDOM_INT, [higher, lower], attrs, higher.shape, dtype)


def static_shape(shape, what: str) -> tuple[int, ...]:
    """``shape`` (an int or a sequence of ints, none traced) as a tuple; a clear error otherwise."""
    dims = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise ValueError(f"{what} need a static shape (non-negative Python ints); got {shape!r}")
    return tuple(int(d) for d in dims)


# ================================================================ kernels
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA  # Threefish's key-schedule parity constant


CHUNK = 1 << 18  # entries NumPy hashes at a time: few ufunc calls per entry, the words (3 MiB) near cache


def threefry_words(xp, key, x0, x1):
    """Threefry-2x32 (20 rounds) of the counter words ``x0``, ``x1`` (uint32 arrays, broadcast) under ``key``
    (uint32 (2,)): the two output words. Vectorized: whole-array adds, shifts and xors, in place, over chunks
    that stay in cache on NumPy (CuPy: one chunk, so one pass of kernels); flattened, so 0-d counts stay
    arrays (NumPy scalars would warn on the wrapping adds)."""
    k0, k1 = int(key[0]), int(key[1])
    ks = (k0, k1, k0 ^ k1 ^ _PARITY)
    shape = np.broadcast_shapes(x0.shape, x1.shape)
    y0 = xp.broadcast_to(x0, shape).astype(np.uint32).reshape(-1)
    y1 = xp.broadcast_to(x1, shape).astype(np.uint32).reshape(-1)
    chunk = CHUNK if xp is np else max(y0.size, 1)
    spare = xp.empty(min(chunk, y0.size), np.uint32)
    for start in range(0, y0.size, chunk):
        a, b = y0[start:start + chunk], y1[start:start + chunk]
        _rounds(xp, ks, a, b, spare[:a.size])
    return y0.reshape(shape), y1.reshape(shape)


def _rounds(xp, ks, y0, y1, spare):
    """The 20 rounds on one chunk, in place (``spare``: a temporary of the chunk's size)."""
    y0 += np.uint32(ks[0])
    y1 += np.uint32(ks[1])
    for group in range(5):
        for r in _ROTATIONS[group % 2]:
            y0 += y1
            xp.left_shift(y1, np.uint32(r), out=spare)
            xp.right_shift(y1, np.uint32(32 - r), out=y1)
            y1 |= spare
            y1 ^= y0
        y0 += np.uint32(ks[(group + 1) % 3])
        y1 += np.uint32((ks[(group + 2) % 3] + group + 1) % 2 ** 32)


@opdef.kernel(THREEFRY)
def _threefry_kernel(xp, key, counts):
    y0, y1 = threefry_words(xp, key, counts[..., 0], counts[..., 1])
    return xp.stack([y0, y1], axis=-1)


def _linear_index(xp, shape, global_shape, starts):
    """The row-major global linear index (uint64) of every entry of the block of ``shape`` at ``starts``."""
    index = xp.zeros(shape, dtype=np.uint64)
    for d, (n, start) in enumerate(zip(shape, starts)):
        stride = math.prod(global_shape[d + 1:])
        along = (xp.arange(start, start + n, dtype=np.uint64) * np.uint64(stride))
        index += along.reshape([-1 if e == d else 1 for e in range(len(shape))])
    return index


@opdef.kernel(RANDOM_BITS)
def _random_bits_kernel(xp, key, *shard, shape, global_shape, width, split=(), blocks=()):
    """The bits of this block: its entries' global linear indices hashed; a shard operand per split dim gives
    the block's offset there (shard number * block size)."""
    starts = [0] * len(shape)
    for d, s, b in zip(split, shard, blocks):
        starts[d] = int(s) * int(b)
    index = _linear_index(xp, tuple(shape), tuple(global_shape), starts)
    y0, y1 = threefry_words(xp, key, (index >> np.uint64(32)).astype(np.uint32), index.astype(np.uint32))
    if width == 64:
        return (y0.astype(np.uint64) << np.uint64(32)) | y1.astype(np.uint64)
    bits = y0 ^ y1
    return bits if width == 32 else bits.astype(BIT_WIDTHS[width])


@opdef.kernel(RANDOM_UNIT)
def _random_unit_kernel(xp, bits, dtype):
    dtype = np.dtype(dtype)
    unsigned, nbits = bits.dtype, 8 * dtype.itemsize
    mantissa = MANTISSA_BITS[dtype.name]
    one = np.array(1.0, dtype).view(unsigned)
    return ((bits >> unsigned.type(nbits - mantissa)) | one).view(dtype) - dtype.type(1.0)


@opdef.kernel(RANDOM_INT)
def _random_int_kernel(xp, higher, lower, minval, span, multiplier, dtype):
    if span == 2 ** (8 * higher.itemsize):  # every n-bit value: the bits themselves
        offset = lower
    else:
        unsigned = higher.dtype.type
        span, multiplier = unsigned(span), unsigned(multiplier)
        offset = ((higher % span) * multiplier + lower % span) % span  # n-bit unsigned: wraps as JAX's randint
    return (offset.astype(dtype) + np.dtype(dtype).type(minval)).astype(dtype, copy=False)
