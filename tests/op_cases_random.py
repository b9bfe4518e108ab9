"""Op cases of the random family (ops/random.py, spmd_runtime.random, nn.dropout), in the format of
``op_cases.CASES``, and the independent reference they are checked against.

The reference is Threefry-2x32 (20 rounds) written here from the Random123 specification on Python ints, one
entry at a time (slow, and independent of the vectorized kernel), with JAX's partitionable counter layout:
the entry at row-major index i of a random array hashes the words (i >> 32, i & 0xFFFFFFFF), and its 32 bits
are the xor of the two output words. The random arrays are added to a sharded operand, so propagation splits
them like it; every mesh must give the bits of the global array.
"""
from __future__ import annotations

import numpy as np

from op_cases import Case

MASK = 0xFFFFFFFF
ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
KEY = np.array([0x12345678, 0x9ABCDEF0], dtype=np.uint32)


def _rotl(v, r):
    return ((v << r) | (v >> (32 - r))) & MASK


def threefry_ref(key, counter):
    """Threefry-2x32-20 of one counter pair (ints) under key (two ints): the two output words."""
    k0, k1 = int(key[0]), int(key[1])
    ks = [k0, k1, k0 ^ k1 ^ 0x1BD11BDA]
    x0, x1 = (int(counter[0]) + ks[0]) & MASK, (int(counter[1]) + ks[1]) & MASK
    for i in range(20):
        x0 = (x0 + x1) & MASK
        x1 = _rotl(x1, ROTATIONS[(i // 4) % 2][i % 4]) ^ x0
        if i % 4 == 3:  # key injection after every 4 rounds
            s = i // 4 + 1
            x0 = (x0 + ks[s % 3]) & MASK
            x1 = (x1 + ks[(s + 1) % 3] + s) & MASK
    return x0, x1


def bits_ref(key, shape, width=32):
    """The random bits of ``shape`` under ``key`` (JAX's partitionable layout), entry by entry."""
    out = np.zeros(int(np.prod(shape)), dtype=f"uint{width}")
    for i in range(out.size):
        y0, y1 = threefry_ref(key, (i >> 32, i & MASK))
        out[i] = (y0 << 32 | y1) if width == 64 else (y0 ^ y1) & ((1 << width) - 1)
    return out.reshape(shape)


def uniform_ref(key, shape, dtype="float32"):
    """JAX's uniform in [0, 1): the top mantissa bits under the exponent of 1.0, minus 1."""
    dtype = np.dtype(dtype)
    width, mantissa = {4: (32, 23), 8: (64, 52)}[dtype.itemsize]
    bits = bits_ref(key, shape, width).astype(object)
    one = int(np.array(1.0, dtype).view(f"uint{width}"))
    words = np.array([(b >> (width - mantissa)) | one for b in bits.ravel()], dtype=f"uint{width}")
    return words.view(dtype).reshape(shape) - dtype.type(1.0)


def dropout_ref(key, x, rate):
    keep = uniform_ref(key, x.shape, "float32") < np.float32(1.0 - rate)
    return np.where(keep, x / (1.0 - rate), 0.0)


def _with_uniform(m, x):
    if m is np:
        return x + uniform_ref(KEY, x.shape, "float64")
    import spmd_runtime.random as srandom
    return x + srandom.uniform(KEY, x.shape, "float64")


def _with_bits(m, x):
    if m is np:
        return x * bits_ref(KEY, x.shape).astype(np.float64)
    import spmd_runtime.random as srandom
    return x * srandom.bits(KEY, x.shape).astype("float64")


def _dropout(m, x):
    if m is np:
        return dropout_ref(KEY, x, 0.25)
    import spmd_runtime.nn as snn
    return snn.dropout(KEY, x, 0.25)


A_, B_, AB = ("A", None), (None, "A"), ("A", "B")
CASES = [
    Case("random_uniform_even", _with_uniform, ((24, 24),), ((A_,), (B_,), (AB,), (("B", "A"),))),
    Case("random_uniform_uneven", _with_uniform, ((10, 7),), ((A_,), (B_,), ((("A", "B"), None),))),
    Case("random_bits_3d", _with_bits, ((5, 24, 3),), (((None, "A", None),), (("B", "A", None),))),
    Case("random_dropout", _dropout, ((24, 12),), ((A_,), (AB,))),
    Case("random_dropout_uneven", _dropout, ((7, 9),), ((B_,), (AB,))),
]
