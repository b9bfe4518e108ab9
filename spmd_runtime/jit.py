"""``sr.jit``: trace, partition and run in one call, cached per input signature (``jax.jit``).

The signature of a call is the pytree structure of the non-static arguments,
each leaf's shape, dtype and (for DArrays) sharding, and the static arguments.
A new signature traces and partitions once; later calls with it reuse the
program. Every call first checks, collectively, that all ranks have the same
signature and compiled without error, so a rank with different shapes (or a
failed trace) raises on EVERY rank before any collective of the run.

Arguments may be DArrays (their blocks are used as they are: nothing global is
built) or global arrays present on every rank (each rank keeps its block; the
ranks agree on a digest of each in the same exchange, ``check_inputs``).
Results are DArrays in the function's output structure.
"""
from __future__ import annotations

import builtins
import inspect

import numpy as np

from . import pytree
from .comm.agreement import (AgreedError, DifferentValuesError, agree, capture, check_same, digests, plain_data_error,
                             ranks_by_value)
from .darray import DArray
from .dtypes import config
from .exec.runner import SKIP, Runtime, communicator, program_difference, run_local, settings_difference, shard
from .graph import TensorSpec
from .mesh import Mesh, get_mesh
from .partition import partition
from .profile import profiling
from .sharding import P, Sharding, parse_spec
from .trace import current_graph, mesh_split, trace, user_line_of


def jit(fn=None, *, mesh: Mesh | None = None, in_specs=None, out_specs=None, static_argnums=(), profile=None,
        comm=None, donate_argnums=(), check_inputs: bool | None = None):
    """``fn`` compiled for ``mesh`` (default: the context mesh at call time).

    ``in_specs`` / ``out_specs``: ``P`` specs as a pytree prefix of the
    arguments (a tuple, one entry per non-static argument) / of the result;
    ``None`` leaves it to propagation (a DArray argument keeps its own
    sharding). ``static_argnums``: positions passed to ``fn`` as Python values
    (part of the cache key, as is the x64 switch). ``profile``: a directory; each call writes one
    Chrome trace per rank there (see ``spmd_runtime.profile``).
    ``donate_argnums``: positions of arguments whose buffers the program may overwrite (JAX's): a DArray
    argument's local blocks are then consumed by the call (do not use it afterwards); a NumPy argument's
    blocks are copied first, so the array itself is left as it was.
    ``check_inputs`` (default True, or ``$SPMD_CHECK_INPUTS=0``): each call's NumPy (global) arguments are
    compared across ranks by digest, in the exchange the call makes anyway (one pass over their bytes).
    """
    if fn is None:
        return lambda f: jit(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, static_argnums=static_argnums,
                             profile=profile, comm=comm, donate_argnums=donate_argnums, check_inputs=check_inputs)
    return Jitted(fn, mesh, in_specs, out_specs, static_argnums, profile, comm, donate_argnums, check_inputs)


def _is_spec(x) -> bool:
    return isinstance(x, (P, Sharding))


class Jitted:
    def __init__(self, fn, mesh, in_specs, out_specs, static_argnums, profile, comm, donate_argnums=(),
                 check_inputs=None):
        self.fn, self.mesh, self.in_specs, self.out_specs = fn, mesh, in_specs, out_specs
        self.check_inputs = check_inputs
        self.static = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
        self.donate = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
        self.profile, self.comm = profile, comm
        self._cache: dict = {}
        self.hits = self.misses = 0
        self.__name__ = getattr(fn, "__name__", "jitted")
        self.__doc__ = getattr(fn, "__doc__", None)

    def cache_info(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "size": len(self._cache)}

    # ------------------------------------------------------------ calling
    def __call__(self, *args):
        mesh, comm = self._mesh(args), self._comm(args)
        mc, rt = communicator(mesh, comm), Runtime.of(comm)
        check = rt.checks_inputs(self.check_inputs)
        try:  # a failure is agreed on by every rank before anything runs
            compiled, failure = self._digested(mesh, args, check), None
        except Exception as e:  # noqa: BLE001 - whatever fails here must be agreed on, not raised on one rank
            compiled, failure = None, e
        program, leaves, sums = compiled or (None, None, None)
        described, _ = capture(_describe_args, args)  # one it cannot describe fails to compile: agreed on below
        _agree_call(rt, mc, program, failure, described, sums, self.__name__)
        donated = program.donated  # a NumPy argument's blocks are views of it: donated ones are copied
        blocks = [x.local if isinstance(x, DArray) else shard(x, s.sharding, mesh, mc.rank, own=k in donated)
                  for k, (x, s) in enumerate(zip(leaves, program.inputs))]
        with profiling(self.profile, f"jit({self.__name__})"):
            outs = run_local(program, *blocks, comm=comm)
        for k in donated:  # consumed, as JAX's donated arrays: a later use raises instead of reading the result
            if isinstance(leaves[k], DArray):
                leaves[k].delete(f"donated to jit({self.__name__}) (donate_argnums)")
        return program.out_tree.unflatten(DArray(o, s.shape, s.dtype, mesh, s.sharding, comm)
                                          for o, s in zip(outs, program.outputs))

    def lower(self, *args):
        """The SPMDProgram this call would run (traced and partitioned, cached; nothing runs). ``args`` may be
        abstract: ``sr.TensorSpec``s or any leaf with ``.shape`` and ``.dtype`` (jax's ``ShapeDtypeStruct``),
        so a program of any size is planned without allocating its inputs."""
        program, _ = self._compiled(self._mesh(args), args)
        return program

    def _digested(self, mesh, args, check: bool):
        """(program, leaves, digests of the NumPy leaves or None): what a call agrees on."""
        program, leaves = self._compiled(mesh, args)
        return program, leaves, digests([None if isinstance(x, DArray) else x for x in leaves]) if check else None

    def _compiled(self, mesh, args):
        static, dynamic = self._split(args)
        leaves, tree = pytree.flatten(dynamic)
        leaves = [_as_leaf(x) for x in leaves]
        if all((not isinstance(x, DArray) or x.mesh == mesh) and plain_data_error(x, "", "") is None for x in leaves):
            paths = ()  # every leaf fits: no paths to name (flatten_with_path costs more than the whole check)
        else:
            paths = pytree.flatten_with_path(dynamic)[0]
        for (path, _), x in zip(paths, leaves):
            if isinstance(x, DArray) and x.mesh != mesh:
                raise ValueError(f"a DArray argument must live on the jit mesh {mesh}; got "
                                 f"{pytree.keystr(path, 'args')} on {x.mesh} (move it with sr.device_put(x, spec, "
                                 f"mesh))")
            refused = plain_data_error(x, pytree.keystr(path, "args"), f"jit({self.__name__})")
            if refused:
                raise TypeError(refused)
        # the x64 switch changes what tracing makes of the same inputs (sum of int32 is int64 with it), so it keys
        key = (tree, _static_key(static), mesh, config.enable_x64,
               tuple((tuple(x.shape), np.dtype(x.dtype).name, x.sharding if isinstance(x, DArray) else None)
                     for x in leaves))
        program = self._cache.get(key)
        if program is None:
            self.misses += 1
            program = self._cache[key] = self._build(mesh, static, dynamic, leaves, tree)
        else:
            self.hits += 1
        return program, leaves

    def _build(self, mesh, static, dynamic, leaves, tree):
        specs, reduce_to = self._input_specs(dynamic, leaves)
        fn, positions = self.fn, [i for i in range(len(static) + len(dynamic)) if i not in static]

        scalars = _python_number_leaves(positions, dynamic)

        def traced(*dyn):
            g = current_graph()  # a Python number traced as a 0-d array: its misuse names static_argnums
            g.scalar_args = {g.params[k]: (position, g.param_names[k], kind) for k, (position, kind) in scalars.items()}
            if reduce_to:  # partial DArrays where final values are declared: the planner completes the sums
                flat = pytree.flatten(dyn)[0]
                dyn = tree.unflatten(mesh_split(x, mesh, reduce_to[k]) if k in reduce_to else x
                                     for k, x in enumerate(flat))
            full = [None] * (len(static) + len(dyn))
            for i, v in static.items():
                full[i] = v
            for i, v in zip(positions, dyn):
                full[i] = v
            return fn(*full)
        traced.__signature__ = _dynamic_signature(fn, positions)
        with mesh:
            graph = trace(traced, *tree.unflatten(TensorSpec(tuple(x.shape), np.dtype(x.dtype).name) for x in leaves))
            outs = None
            if self.out_specs is not None:
                outs = pytree.broadcast_prefix(self.out_specs, graph.out_tree.unflatten([0] * len(graph.outputs)),
                                               _is_spec, "out_specs")
            return partition(graph, mesh, in_specs=specs, out_specs=outs, donate=self._donated_leaves(static, dynamic))

    def _donated_leaves(self, static, dynamic) -> list[int]:
        """Flat input positions of the leaves of the arguments at ``donate_argnums``."""
        n = len(static) + len(dynamic)
        bad = [i for i in self.donate if not isinstance(i, int) or not 0 <= i < n or i in static]
        if bad:
            raise ValueError(f"donate_argnums must index the {n} arguments, none of them static ({sorted(static)}); "
                             f"got {bad}")
        positions = [i for i in range(n) if i not in static]
        leaves, first = [], 0
        for i, arg in zip(positions, dynamic):
            count = len(pytree.flatten(arg)[0])
            if i in self.donate:
                leaves += range(first, first + count)
            first += count
        return leaves

    def _input_specs(self, dynamic, leaves) -> tuple[list, dict]:
        """(one spec per leaf, {leaf: declared Sharding} for partial DArrays declared as final values)."""
        specs = [None] * len(leaves) if self.in_specs is None else \
            pytree.broadcast_prefix(tuple(self.in_specs) if isinstance(self.in_specs, list) else self.in_specs,
                                    dynamic, _is_spec, "in_specs")
        names = [pytree.keystr(p, "args") for p, _ in pytree.flatten_with_path(dynamic)[0]]
        reduce_to = {}
        for k, (x, spec) in enumerate(zip(leaves, specs)):
            if isinstance(x, DArray):
                declared = x.sharding if spec is None else _sharding(spec, x)
                if declared != x.sharding and declared.on_split_axes(x.mesh) == x.sharding.on_split_axes(x.mesh):
                    declared = x.sharding  # they differ only in axes of size 1: the same blocks on every rank
                if declared != x.sharding and not (x.sharding.partial and not declared.partial):
                    raise ValueError(f"in_specs must match the layout of a DArray argument (a partial one may be "
                                     f"declared final: its sums are completed); got {spec!r} for {names[k]}, laid "
                                     f"out as {x.sharding} (reshard it with sr.device_put)")
                if declared != x.sharding:
                    reduce_to[k] = declared
                specs[k] = x.sharding
        return specs, reduce_to

    def _split(self, args):
        bad = [i for i in self.static if not 0 <= i < len(args)]
        if bad:
            raise ValueError(f"static_argnums must index the {len(args)} arguments; got {bad}")
        return {i: args[i] for i in self.static}, tuple(a for i, a in enumerate(args) if i not in self.static)

    def _mesh(self, args) -> Mesh:
        if self.mesh is not None:
            return self.mesh
        mesh = get_mesh()
        if mesh is None:  # the mesh of a DArray argument
            mesh = next((x.mesh for x in pytree.flatten(args)[0] if isinstance(x, DArray)), None)
        if mesh is None:
            get_mesh(required_by=f"jit({self.__name__})")
        return mesh

    def _comm(self, args):
        if self.comm is not None:
            return self.comm
        return next((x.comm for x in pytree.flatten(args)[0] if isinstance(x, DArray)), None)


def _python_number_leaves(positions, dynamic) -> dict:
    """{flat leaf: (argument position, 'int' / 'float' / 'bool')} for the arguments that are Python numbers."""
    out, first = {}, 0
    for position, arg in zip(positions, dynamic):
        if isinstance(arg, (bool, int, float)):
            out[first] = (position, type(arg).__name__)
        first += len(pytree.flatten(arg)[0])
    return out


def _sharding(spec, x):
    return parse_spec(spec, x.mesh, x.ndim, "in_specs")


def _as_leaf(x):
    """Arrays and DArrays as they are; Python scalars as 0-d arrays (float32, int64, bool)."""
    if isinstance(x, DArray) or (hasattr(x, "shape") and hasattr(x, "dtype")):
        return x
    if isinstance(x, bool):
        return np.asarray(x)
    if isinstance(x, (int, float)):
        return np.asarray(x, "float32" if isinstance(x, float) else "int64")
    raise TypeError(f"jit arguments are pytrees of arrays, DArrays or Python numbers; got {type(x).__name__} "
                    f"(mark Python values static with static_argnums)")


def _static_key(static: dict):
    try:
        hash(tuple(static.items()))
    except TypeError as e:
        raise TypeError(f"static arguments key the cache, so they must be hashable; got {static!r}") from e
    return tuple(sorted((i, repr(v)) for i, v in static.items()))


def _dynamic_signature(fn, positions):
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return None
    chosen = [params[i].replace(kind=inspect.Parameter.POSITIONAL_ONLY, default=inspect.Parameter.empty)
              if i < len(params) else inspect.Parameter(f"arg{i}", inspect.Parameter.POSITIONAL_ONLY)
              for i in positions]
    return inspect.Signature(chosen)


def _describe_args(args) -> str:
    return repr(pytree.tree_map(lambda x: f"{np.dtype(x.dtype).name}{list(x.shape)}" if hasattr(x, "shape")
                                else x, args))


class CompileError(AgreedError, ValueError):
    """Raised alike on every rank by ``jit`` when tracing or partitioning failed on some rank and the error's type
    cannot be kept: otherwise every rank raises the type of the lowest failing rank's error (``keep_type``; on
    a rank that failed, chained to its own error)."""


def _where(failure: BaseException) -> str:
    """``" (at /path/model.py:12)"``: the user's line in the traceback of a failure while tracing."""
    line = user_line_of(failure)
    return "" if line is None else f" (at {line[0]}:{line[1]})"


def keep_type(cls: type, agreed: AgreedError) -> BaseException:
    """An exception of type ``cls`` (a subclass that is also an AgreedError, carrying ``ranks``) with the agreed
    message: ``except AttributeError`` still catches a traced AttributeError, and the job guard still prints it
    as an error every rank raised. A type that cannot be subclassed so gives the agreed error itself."""
    try:
        typed = _TYPED.get(cls) or _TYPED.setdefault(cls, type(cls.__name__, (cls, AgreedError), {
            "__module__": cls.__module__, "__qualname__": cls.__qualname__, "__init__": BaseException.__init__,
            "__str__": BaseException.__str__}))
        error = typed(str(agreed))
    except Exception:  # noqa: BLE001 - a layout conflict, a final class, an odd constructor: the agreed error
        return agreed
    error.ranks, error.messages = agreed.ranks, agreed.messages
    return error


def _agreed_type(failure, agreed: AgreedError):
    """The type every rank raises: that of the lowest failing rank's error, this rank's own when it is that one,
    else a builtin exception of that name, else None (the agreed CompileError)."""
    name = agreed.messages[min(agreed.messages)].split(":", 1)[0] if agreed.messages else ""
    if failure is not None and type(failure).__name__ == name:
        return type(failure)
    builtin = getattr(builtins, name, None)
    return builtin if isinstance(builtin, type) and issubclass(builtin, Exception) else None


_TYPED: dict = {}  # exception type -> its agreed subclass


def _agree_call(rt, mc, program, failure, described, sums, name):
    """One allgather: every rank compiled without error to the same program (else: what differs, the
    arguments, the settings or the traced code) from the same NumPy argument values, or every rank raises:
    the ranks that failed with their own exception's type, chained to it, the others a CompileError; every
    message names each failing rank's error and the user's line it failed at."""
    mine = (None if program is None else program.hash, described, rt.settings_key, sums)
    error = None if failure is None else f"{type(failure).__name__}: {failure}{_where(failure)}"
    try:
        gathered = agree(mc.comm, error, f"jit({name})", mine, CompileError,
                         rule=f"jit({name}) compiles on every rank before it runs")
    except CompileError as agreed:
        cls = _agreed_type(failure, agreed)
        if cls is None:
            raise
        raise keep_type(cls, agreed) from failure
    ranks = list(range(len(gathered)))
    if len({g[0] for g in gathered}) > 1:
        if len({g[1] for g in gathered}) > 1:
            by_description = ranks_by_value([g[1] for g in gathered])
            details = "; ".join(f"ranks {group}: {desc}" for desc, group in by_description.items())
            raise DifferentValuesError(f"jit({name}) must be called with the same argument shapes, dtypes, "
                                       f"shardings and structure on every rank; got {details}", ranks)
        why = settings_difference(rt.comm, rt.settings) if len({g[2] for g in gathered}) > 1 else \
            (f"the same arguments and settings, but the function traced to "
             f"{program_difference(rt.comm, program)} (its code or the values it closes over depend on the rank)")
        raise DifferentValuesError(f"jit({name}) must build the same program on every rank; {why}", ranks)
    check_same([g[3] for g in gathered], [i.name for i in program.inputs],
               f"jit({name}) needs the same value for each NumPy argument on every rank (a global array: each "
               f"rank takes its block of it; pass a DArray of per-rank blocks instead)", SKIP)
