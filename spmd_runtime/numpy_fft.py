"""``spmd_runtime.numpy.fft`` (``snp.fft``): the discrete Fourier transforms of NumPy's ``numpy.fft`` / the Array
API's ``fft`` extension (``ops/fft.py``: each transformed axis whole on a rank, the other dims split)."""
from . import dispatch
from .ops.fft import (fft, fftfreq, fftn, fftshift, hfft, ifft, ifftn, ifftshift, ihfft, irfft, irfftn, rfft,
    rfftfreq, rfftn)

__all__ = ["fft", "ifft", "fftn", "ifftn", "rfft", "irfft", "rfftn", "irfftn", "hfft", "ihfft", "fftfreq",
           "rfftfreq", "fftshift", "ifftshift"]

dispatch.wrap_functions(globals(), __all__)  # eager on DArrays, as spmd_runtime.numpy's
