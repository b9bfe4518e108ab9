"""The VJP rules of the ``ops/manual.py`` family, registered in ``table.py``."""
from __future__ import annotations
