"""Reading .npy data from several threads at once.

``np.load`` parses each header with ``ast.literal_eval``. CPython 3.11 keeps the AST constructor's recursion depth
per interpreter, not per thread (python/cpython#106905), so two threads parsing at once can fail with
"SystemError: AST constructor recursion depth mismatch". Simulated ranks are threads, so every .npy read in the
package goes through ``load_npy``, which parses one header at a time; a memory-mapped load returns at once, so the
lock costs nothing on the data path.
"""
from __future__ import annotations

import threading

import numpy as np

_HEADER_LOCK = threading.Lock()


def load_npy(file, **kwargs) -> np.ndarray:
    """``np.load(file, allow_pickle=False, **kwargs)``, one thread at a time (see the module docstring)."""
    with _HEADER_LOCK:
        return np.load(file, allow_pickle=False, **kwargs)
