"""The VJP rules of the ``ops/control.py`` family, registered in ``table.py``."""
from __future__ import annotations
