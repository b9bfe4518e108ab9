"""Reverse-mode automatic differentiation (``engine.py``: the walk, ``grad`` / ``value_and_grad``; ``loops.py``:
differentiating loop bodies) and its rule table (``rules/``: one VJP per op record, a module per op family)."""
from . import rules  # noqa: F401  (fills the VJP table)
from .engine import backward, backward_from, grad, value_and_grad

__all__ = ["backward", "backward_from", "grad", "value_and_grad"]
