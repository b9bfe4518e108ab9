"""The autodiff layer's rule table, keyed by op record (filled by the family modules beside this one):
``VJP``: ``fn(node, cotangent, operands, result) -> [cotangent | None | thunk]`` per graph op, written with
traced ops, read by ``autodiff/engine.py``."""
from __future__ import annotations

from ...opdef import RuleTable

VJP = RuleTable("vjp")
vjp = VJP.register  # decorate fn(node, cotangent, operands, result) as the VJP of ops
