"""Discrete Fourier transforms (the Array API's ``fft`` extension 2023.12, NumPy's ``numpy.fft``): ONE record,
``fourier_transform``, whose ``fn`` attribute names the array module's routine (``xp.fft.<fn>``: fft, ifft, rfft, irfft, hfft,
ihfft and the n-d fftn, ifftn, rfftn, irfftn), with the transformed ``axes``, their lengths ``s`` (None: the
operand's) and ``norm`` ("backward", "ortho" or "forward"); plus ``fftfreq`` / ``rfftfreq`` (iotas) and
``fftshift`` / ``ifftshift`` (rolls), composed of other ops.

A transform reads its whole axes: the partition rule (``partition/rules/fft.py``) makes them whole on every rank
and keeps every other dim split as the result wants it. Results keep the operand's precision (float32 in,
complex64 out; integers and bools are transformed in the default float dtype). The VJPs
(``autodiff/rules/fft.py``) refuse: the autodiff is real, and these are complex maps.
"""
from __future__ import annotations

import numpy as np

from .. import opdef
from ..dtypes import default_float
from ..opdef import define
from ..trace import Tensor, emit
from . import core
from .core import normalize_axis
from .slicing import arange, concatenate, roll

__all__ = ["fft", "ifft", "fftn", "ifftn", "rfft", "irfft", "rfftn", "irfftn", "hfft", "ihfft", "fftfreq",
           "rfftfreq", "fftshift", "ifftshift"]

FFT = define("fourier_transform")  # not "fft": that is also a function (and a namespace) name
NORMS = ("backward", "ortho", "forward")
ONE_D = ("fft", "ifft", "rfft", "irfft", "hfft", "ihfft")
N_D = ("fftn", "ifftn", "rfftn", "irfftn")
HALF_IN = ("irfft", "hfft", "irfftn")  # take a half spectrum: the last axis grows to n (default 2 * (m - 1))
HALF_OUT = ("rfft", "ihfft", "rfftn")  # make one of real input: the last axis shrinks to n // 2 + 1
REAL_OUT = ("irfft", "hfft", "irfftn")


def _complex(dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    return dtype if dtype.kind == "c" else np.result_type(dtype, np.complex64)


def _transform(fn: str, x, s, axes, norm) -> Tensor:
    x = core.asarray(x)
    x = x if x.dtype.kind in "fc" else core.astype(x, default_float())
    if norm not in NORMS:
        raise ValueError(f"fft.{fn}'s norm must be one of {NORMS}; got norm={norm!r}")
    if x.ndim == 0:
        raise ValueError(f"fft.{fn} needs an array of rank >= 1; got shape {x.shape}")
    axes = tuple(range(x.ndim)) if axes is None else tuple(normalize_axis(a, x.ndim) for a in core.as_tuple(axes))
    lengths = [x.shape[a] for a in axes] if s is None else [int(n) for n in core.as_tuple(s)]
    if len(set(axes)) != len(axes) or len(lengths) != len(axes) or any(n < 1 for n in lengths):
        raise ValueError(f"fft.{fn} takes distinct axes and one length >= 1 each; got axes={axes}, s={s!r} for shape "
                         f"{x.shape}")
    if fn in HALF_IN and s is None:
        lengths[-1] = 2 * (x.shape[axes[-1]] - 1)
        if lengths[-1] < 1:
            raise ValueError(f"fft.{fn} of a length-1 half spectrum needs n (or s); got shape {x.shape}")
    shape = list(x.shape)
    for a, n in zip(axes, lengths):
        shape[a] = n
    if fn in HALF_OUT:
        shape[axes[-1]] = lengths[-1] // 2 + 1
    if fn in HALF_OUT and x.dtype.kind == "c":
        raise ValueError(f"fft.{fn} transforms real input (its spectrum is Hermitian); got {x.dtype} (use fft.fft)")
    real = _component(x.dtype)
    dtype = real if fn in REAL_OUT else _complex(real)
    return emit(FFT, [x], {"fn": fn, "s": tuple(lengths), "dims": axes, "norm": norm}, tuple(shape), dtype)


def _component(dtype) -> np.dtype:
    return np.dtype(dtype).type(0).real.dtype


def _one_d(fn):
    def transform(x, /, *, n=None, axis=-1, norm="backward") -> Tensor:
        return _transform(fn, x, None if n is None else (n,), (axis,), norm)
    transform.__name__ = transform.__qualname__ = fn
    transform.__doc__ = f"NumPy's / the Array API's ``fft.{fn}`` along ``axis`` (length ``n``: cropped or zero-padded)."
    return transform


def _n_d(fn):
    def transform(x, /, *, s=None, axes=None, norm="backward") -> Tensor:
        return _transform(fn, x, s, axes if axes is not None or s is None else tuple(range(-len(s), 0)), norm)
    transform.__name__ = transform.__qualname__ = fn
    transform.__doc__ = f"NumPy's / the Array API's ``fft.{fn}`` over ``axes`` (all by default) of lengths ``s``."
    return transform


fft, ifft, rfft, irfft, hfft, ihfft = (_one_d(f) for f in ONE_D)
fftn, ifftn, rfftn, irfftn = (_n_d(f) for f in ("fftn", "ifftn", "rfftn", "irfftn"))


# ---------------------------------------------------------------- frequencies and shifts
def _count(n, what: str) -> int:
    if isinstance(n, Tensor) or not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
        raise ValueError(f"{what} takes a static int n >= 1; got n={n!r}")
    return int(n)


def fftfreq(n, /, *, d=1.0, dtype=None, device=None) -> Tensor:
    """The sample frequencies of an ``n``-point transform: [0, 1, ..., -(n // 2), ..., -1] / (d * n)."""
    core.check_device(device, "fftfreq")
    n = _count(n, "fftfreq")
    dtype = default_float() if dtype is None else np.dtype(dtype)
    k = concatenate([arange(0, (n - 1) // 2 + 1, dtype=dtype), arange(-(n // 2), 0, dtype=dtype)])
    return core.divide(k, np.asarray(d * n, dtype))


def rfftfreq(n, /, *, d=1.0, dtype=None, device=None) -> Tensor:
    """The sample frequencies of an ``n``-point ``rfft``: [0, 1, ..., n // 2] / (d * n)."""
    core.check_device(device, "rfftfreq")
    n = _count(n, "rfftfreq")
    dtype = default_float() if dtype is None else np.dtype(dtype)
    return core.divide(arange(0, n // 2 + 1, dtype=dtype), np.asarray(d * n, dtype))


def _shift(x, axes, sign: int) -> Tensor:
    x = core.asarray(x)
    axes = tuple(range(x.ndim)) if axes is None else tuple(normalize_axis(a, x.ndim) for a in core.as_tuple(axes))
    for a in axes:
        x = roll(x, sign * (x.shape[a] // 2), a)
    return x


def fftshift(x, /, *, axes=None) -> Tensor:
    """The zero frequency moved to the middle of ``axes`` (all by default): a roll by n // 2."""
    return _shift(x, axes, 1)


def ifftshift(x, /, *, axes=None) -> Tensor:
    """``fftshift``'s inverse: a roll by -(n // 2)."""
    return _shift(x, axes, -1)


# ================================================================ kernel
@opdef.kernel(FFT)
def _fft_kernel(xp, x, fn, s, dims, norm):  # "dims", not "axes": a program's "axes" name mesh axes
    axes = dims
    routine = getattr(xp.fft, fn)  # fn comes from a program: one of the names above
    if fn not in ONE_D + ("fftn", "ifftn", "rfftn", "irfftn"):
        raise ValueError(f"unknown transform {fn!r}")
    out = routine(x, n=s[0], axis=axes[0], norm=norm) if fn in ONE_D else routine(x, s=s, axes=axes, norm=norm)
    want = _component(x.dtype) if fn in REAL_OUT else _complex(_component(x.dtype))
    return out.astype(want, copy=False)
