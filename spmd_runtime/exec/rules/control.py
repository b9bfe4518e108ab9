"""The binders of the ``ops/control.py`` family, registered in ``table.py``; the binders themselves are the
loop machinery of ``exec/loops.py`` (each body bound once per rank, run as a loop)."""
from __future__ import annotations

from ...ops.control import COND, SCAN, WHILE
from .. import loops
from .table import BIND

BIND.register(SCAN, value=loops.bind_scan)
BIND.register(WHILE, value=loops.bind_while)
BIND.register(COND, value=loops.bind_cond)
