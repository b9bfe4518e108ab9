"""The VJP rules of the ``ops/einsum.py`` family, registered in ``table.py``."""
from __future__ import annotations
