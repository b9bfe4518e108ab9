"""spmd_runtime: GSPMD on plain MPI.

Annotate a few tensors of a traced function with ``mesh_split``, ``partition``
it into ONE SPMD program, and ``run`` that program on every MPI rank.
"""
from . import dtypes  # noqa: F401  (registers "bfloat16" with NumPy when ml_dtypes is installed)
from .dtypes import config  # sr.config.update("enable_x64", True): JAX's x64 switch (dtypes.py's promotion table)
from .graph import Graph, TensorSpec
from .mesh import Mesh, get_mesh, set_mesh
from .sharding import UNCONSTRAINED, P, Sharding, parse_spec
from . import pytree
from .trace import Tensor, mesh_split, trace
from . import ops  # every op's record; binds the Tensor operators
from . import numpy
from . import lax, nn, random  # jax.lax / jax.nn / jax.random faces: sr.random.key, sr.nn.gelu (not in __all__: a
# star import must not shadow the standard library's random)
from .reference import evaluate
from .partition import partition, plan_reshard
from .program import SPMDProgram, load_program
from .exec import run, run_local
from .autodiff import grad, value_and_grad
from .autodiff.scheduled import pipeline_loss
from .ops.control import checkpoint_name, checkpoint_policies, cond, fori_loop, remat, scan, while_loop
from .ops.core import stop_gradient
from .ops.manual import (all_gather, all_to_all, axis_index, pbroadcast, pmax, pmin, ppermute, psum, psum_scatter,
                         shard_map)
from .pipeline import pipeline
from .checkpoint import checkpoint_info, load_checkpoint, save_checkpoint
from .models.lm import LMConfig
from .optim import (SGD, Adafactor, AdamW, ConstantSchedule, CosineSchedule, DynamicLossScale, LinearSchedule,
                    Schedule, clip_by_global_norm, global_norm, nanogpt_schedule)
from . import data  # noqa: F401  (sr.data: the bundled corpus)
from .tokens import TokenLoader, prepare_corpus
from .darray import DArray, device_put, from_local, scatter_from_root
from .weights import checkpoint_to_safetensors, load_safetensors, safetensors_to_checkpoint, save_safetensors
from .jit import jit
from .autoshard import autoshard
from .autoshard_tensors import autoshard_jit, autoshard_tensors
from .autotune import autotune
from . import eager  # noqa: F401  (binds the DArray operators: eager ops outside jit)
from .visualize import visualize_sharding
from . import profile
from . import distributed
from .train import (PRESETS, FitResult, Model, Plan, Preset, TrainStep, build_train_step, build_train_step_on_root, fit,
                    plan_train_step, token_loaders, train_mesh)

from .exec import Runtime
from .comm.agreement import AgreedError, DifferentValuesError

__version__ = "0.1.0"

# Importing installs nothing. Under mpiexec with more than one rank, sr.distributed.initialize() (or else the
# runtime's first use of MPI) installs the job guard: an uncaught exception, SIGINT/SIGTERM, a rank that exits
# early or a collective nobody joins (SPMD_TIMEOUT) then ends the whole job with the rank named (comm/jobguard.py).

__all__ = ["config", "jit", "autoshard", "autoshard_tensors", "autoshard_jit", "autotune", "DArray", "device_put", "from_local", "scatter_from_root", "visualize_sharding", "profile",
           "distributed", "pytree", "P", "UNCONSTRAINED", "get_mesh", "set_mesh", "Mesh", "Sharding", "parse_spec", "TensorSpec", "Graph", "Tensor", "trace", "mesh_split", "evaluate",
           "partition", "plan_reshard", "SPMDProgram", "load_program", "run", "run_local", "grad", "value_and_grad", "stop_gradient", "checkpoint_name", "checkpoint_policies",
           "scan", "fori_loop", "while_loop", "cond", "remat", "shard_map", "psum", "pmax", "pmin", "all_gather",
           "psum_scatter", "all_to_all", "ppermute", "axis_index", "pbroadcast", "pipeline", "pipeline_loss", "save_checkpoint", "load_checkpoint",
           "checkpoint_info", "LMConfig", "SGD", "AdamW", "Adafactor", "DynamicLossScale", "Schedule", "ConstantSchedule",
           "LinearSchedule", "CosineSchedule", "nanogpt_schedule", "clip_by_global_norm", "global_norm", "TokenLoader",
           "prepare_corpus", "Model", "fit", "FitResult", "token_loaders", "PRESETS", "Preset", "TrainStep", "Plan", "plan_train_step",
           "build_train_step", "build_train_step_on_root", "train_mesh", "Runtime", "AgreedError", "DifferentValuesError",
           "load_safetensors", "save_safetensors", "safetensors_to_checkpoint", "checkpoint_to_safetensors",
           "__version__"]
