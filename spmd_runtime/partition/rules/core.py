"""The propagation and partition rules of the ``ops/core.py`` family, registered in ``table.py``."""
from __future__ import annotations
