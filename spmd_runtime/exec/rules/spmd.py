"""The binders of the ``ops/spmd.py`` family, registered in ``table.py``."""
from __future__ import annotations
