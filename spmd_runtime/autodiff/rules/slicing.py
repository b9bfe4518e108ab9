"""The VJP rules of the ``ops/slicing.py`` family, registered in ``table.py``."""
from __future__ import annotations
