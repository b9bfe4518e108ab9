"""The partition layer's two rule tables, keyed by op record (filled by the family modules beside this one):
``PROPAGATION``: a ``PropagationRule`` (level, forward, backward) per graph op, read by
``partition/propagation.py``; ``PARTITION``: ``fn(ctx, node) -> LocalValue`` per graph op, which proposes
strategies and emits the local ops, read by ``partition/partitioner.py``."""
from __future__ import annotations

from ...opdef import PropagationRule, RuleTable

PROPAGATION = RuleTable("propagation")
PARTITION = RuleTable("partition")


def propagation(*ops, level: int):
    """Decorate ``pair() -> (forward, backward)`` as the propagation rule of ``ops`` at ``level``."""
    def register(pair):
        forward, backward = pair()
        PROPAGATION.register(*ops, value=PropagationRule(level, forward, backward))
        return pair
    return register


partition = PARTITION.register  # decorate fn(ctx, node) -> LocalValue as the partition rule of ops
