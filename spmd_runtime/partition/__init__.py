"""Sharding propagation, the partitioner, its strategy chooser and the resharding planner."""
from . import rules  # noqa: F401  (fills the propagation and partition tables)
from .partitioner import partition
from .propagation import propagate
from .resharding import plan_reshard
