"""Op cases of the Fourier transforms (issue 28: ops/fft.py, the ``fourier_transform`` op, and the frequency and
shift functions composed of other ops), in the format of ``op_cases.CASES``: written once against ``m``, with
``m=numpy`` NumPy's ``np.fft`` (the independent expectation). Uneven sizes (10, 7, 5) with the transformed or the
other dims split over "A", "B" or both."""
from __future__ import annotations

from op_cases import Case

A_, B_, AB, BA = ("A", None), (None, "A"), ("A", "B"), ("B", "A")
SPECS = ((A_,), (B_,), (AB,), (BA,))


def _freq(m, name, n, d):
    """NumPy's frequencies are float64; snp's the default float (float32 without x64): asked as float64."""
    return getattr(m.fft, name)(n, d=d) if m.__name__ == "numpy" else getattr(m.fft, name)(n, d=d, dtype="float64")

CASES = [
    Case("fft_ifft", lambda m, x: m.fft.fft(x) + m.fft.ifft(x, n=10, axis=0, norm="ortho")[:, :1]
         + m.fft.fft(x, n=4, norm="forward")[:1, :1], ((10, 7),), SPECS),
    Case("rfft_irfft", lambda m, x: m.fft.irfft(m.fft.rfft(x), n=7) * 2.0 + m.fft.irfft(m.fft.rfft(x, axis=0), axis=0)
         [:, :1] + m.fft.hfft(m.fft.ihfft(x), n=7), ((10, 7),), SPECS),
    Case("fftn_rfftn", lambda m, x: m.fft.ifftn(m.fft.fftn(x), s=(5, 7)).sum() + m.fft.irfftn(m.fft.rfftn(x, axes=(0, 1)),
         s=(10, 7)) + m.fft.fftn(x, s=(2, 3), axes=(1, 0))[:1, :1], ((10, 7),), SPECS),
    Case("freq_shift", lambda m, x: m.fft.fftshift(x) + m.fft.ifftshift(x, axes=1) * _freq(m, "fftfreq", 7, 0.5)
         + _freq(m, "rfftfreq", 12, 2.0)[:7] - m.fft.fftshift(m.fft.ifftshift(x), axes=(0,)), ((10, 7),), SPECS),
]
