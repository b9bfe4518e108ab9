"""The VJP rules of the ``ops/top_k.py`` family, registered in ``table.py``."""
from __future__ import annotations
