"""The VJP rules of the ``ops/indexing.py`` family, registered in ``table.py``."""
from __future__ import annotations
