"""The VJP rules of the ``ops/windows.py`` family, registered in ``table.py``."""
from __future__ import annotations
