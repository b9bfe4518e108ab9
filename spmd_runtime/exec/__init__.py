"""Runtime: each MPI rank interprets the one SPMD program on its own shards."""
from . import rules  # noqa: F401  (fills the binder table)
from .interpreter import Interpreter
from ..sharding import block_bounds  # the layout rule lives beside Sharding
from .runner import Runtime, block_slices, communicator, run, run_local, shard, unshard

__all__ = ["Interpreter", "Runtime", "block_bounds", "block_slices", "communicator", "run", "run_local", "shard", "unshard"]
