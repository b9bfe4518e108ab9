"""The propagation and partition rules of the ``ops/special.py`` family (erf, erfc, erf_inv), registered in
``table.py``: pointwise ops, so core's elementwise rules (any sharding, no communication; a pending sum is
completed first, since none of them is linear)."""
from __future__ import annotations

from ...opdef import ELEMENTWISE_LEVEL
from ...ops.special import SPECIAL
from . import core
from .table import partition, propagation

propagation(*SPECIAL, level=ELEMENTWISE_LEVEL)(core._elementwise_propagation)
partition(*SPECIAL)(core._elementwise_partition)
