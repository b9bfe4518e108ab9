"""The runtime's rule table, keyed by op record (filled by the family modules beside this one): ``BIND``:
``fn(interpreter, instr) -> callable`` for ops whose behaviour depends on the rank or the communicator
(collectives, layout ops, loops, fusions), resolved once when a program is bound; ops without one run their
record's pure ``kernel``. Read by ``exec/interpreter.py``."""
from __future__ import annotations

from ...opdef import RuleTable

BIND = RuleTable("bind")
bind = BIND.register  # decorate fn(interpreter, instr) -> fn(*operands) -> array as the binder of ops
