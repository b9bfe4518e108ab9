"""Sharding propagation, the partitioner, its strategy chooser and the resharding planner."""
from .partitioner import partition
from .propagation import propagate
from .resharding import plan_reshard
