"""The binders of the ``ops/manual.py`` family, registered in ``table.py``: a shard_map region's is in
``exec/loops.py`` beside the loops' (its body bound once per rank); the collectives inside a region are
partitioned into the ``ops/spmd.py`` collectives, which have their own."""
from __future__ import annotations

from ...ops.manual import SHARD_MAP
from .. import loops
from .table import BIND

BIND.register(SHARD_MAP, value=loops.bind_region)
