"""How ``spmd_runtime.numpy`` functions reach eager DArrays: a call with an operand whose type speaks the
``__spmd_function__`` protocol (a DArray) goes to that type's handler, and a call made outside any trace goes
to ``outside_trace`` (``spmd_runtime/eager.py`` sets both: it runs the call as one cached partitioned program);
traced calls go straight to the function. The NumPy face's modules wrap their functions once, at import
(``wrap_functions``), so the functions themselves know nothing of DArrays and nothing here imports upward."""
from __future__ import annotations

import functools
import inspect

from .trace import trace_state

outside_trace = None  # a call made outside any trace goes here: spmd_runtime/eager.py sets it (None: no eager mode)


def dispatching(fn):
    """``fn``, handing DArray calls and calls outside a trace to the eager handlers (see the module doc)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        handler = _handler(args) or _handler(kwargs.values())
        if handler is None and getattr(trace_state, "graph", None) is None:
            handler = outside_trace
        if handler is not None:
            return handler(fn, args, kwargs)
        return fn(*args, **kwargs)
    return call


def _handler(values):
    """The protocol's handler of the first operand that has one (one level into lists and tuples: concatenate's
    and stack's operands)."""
    for x in values:
        for y in (x if isinstance(x, (list, tuple)) else (x,)):
            handler = getattr(type(y), "__spmd_function__", None)
            if handler is not None:
                return handler
    return None


def wrap_functions(namespace: dict, names, keep=()) -> None:
    """Replace each function of ``names`` in ``namespace`` by its dispatching wrapper; classes, modules,
    constants and the functions in ``keep`` (those of Python values, not arrays) stay as they are."""
    for name in names:
        if inspect.isfunction(namespace[name]) and name not in keep:
            namespace[name] = dispatching(namespace[name])
