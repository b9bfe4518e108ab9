"""This layer's rules for every op family, one module per family of ``spmd_runtime/ops/``, each filling the
tables in ``table.py`` (keyed by the op records). Importing this package loads them all."""
from . import table  # noqa: F401  (first: the families register into it)
from . import spmd, control, manual, fusion, slicing, windows  # noqa: F401,E402  (one module per op family)
