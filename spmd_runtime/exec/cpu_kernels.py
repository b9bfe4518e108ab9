"""Fused instructions as compiled C loops on the CPU: moved to ``exec/backends/numpy_c.py`` (the NumPy
backend); its public names stay importable here."""
from .backends.numpy_c import (CACHE_ENV, KERNELS_ENV, MIN_ENV, CompileError, KernelLibrary, c_function,  # noqa: F401
                               compilable, compiler_available, enabled, min_elements, reducible, warn_fallback)
