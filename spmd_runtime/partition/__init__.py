"""Partitioner: sharding propagation, per-op rules, the resharding planner."""
from . import rules  # noqa: F401  (registers the partition rules)
from .partitioner import PARTITION_RULES, partition, partition_rule
from .propagation import RULES as PROPAGATION_RULES
from .propagation import propagate
from .resharding import plan_reshard

__all__ = ["partition", "partition_rule", "PARTITION_RULES", "PROPAGATION_RULES", "propagate", "plan_reshard"]
