"""Entry points that run an SPMDProgram on every rank.

``run`` takes and returns global arrays (each rank slices its own shards and the
outputs are gathered); ``run_local`` takes and returns this rank's shards only,
for inputs too large for one rank. Both first agree collectively that every
rank holds the same program, valid inputs, the same settings
(``AGREED_SETTINGS``) and backend, and the same values where a caller promises
them (``Promised``: global inputs, a global batch), so a bad input raises on
every rank instead of leaving some blocked in a collective or computing a mix;
a failure during the run itself aborts the whole job with the failing rank's
message.
"""
from __future__ import annotations

import os
import sys
import traceback
import warnings
import zlib
from collections import OrderedDict

import numpy as np

from ..comm import collectives, jobguard, watchdog
from ..comm.collectives import PERSISTENT_ENV, persistent_enabled
from ..comm.affinity import bind_to_cores
from ..comm.agreement import AgreedError, agree, capture, check_same, digests, plain_data_error, ranks_by_value
from ..comm.communicator import MeshCommunicator, world
from ..cost import PROFILE_ENV, resolve_model
from ..devices import is_cupy
from ..dtypes import check_backend
from .. import pytree
from ..partition import fusion, scan_prefetch, schedule, windowed
from ..profile import instrument, profiling
from ..program import SPMDProgram
from . import cpu_kernels, groups
from .backend import backend_name, get_array_module, select_device, to_device
from .buffers import PLAN_ENV, planning_enabled
from .heap import keep_freed_memory
from .interpreter import Interpreter

INTERPRETERS_KEPT = 32  # bound programs a runtime keeps (least recently used dropped first)


class Runtime:
    """What one rank holds to run programs over one communicator: a MeshCommunicator per mesh, the bound
    interpreters, the GPU binding. A context manager: leaving it frees its sub-communicators (collective).

    ``sr.run(..., comm=runtime)`` uses it; ``comm=None`` uses the world runtime (``Runtime.world()``).
    """

    _world: "Runtime | None" = None
    _others: list = []  # runtimes of other mpi4py communicators, found by identity (they are unhashable)
    _process_ready = False

    def __init__(self, comm=None):
        comm = world(comm)  # MPI's first use by the runtime installs the job guard
        if type(comm).__module__.startswith("mpi4py") and not Runtime._process_ready:
            Runtime._process_ready = True
            self._prepare_process()
        self.comm, self.rank, self.size = comm, comm.Get_rank(), comm.Get_size()
        self._meshes: dict = {}
        self._interpreters: OrderedDict = OrderedDict()
        self._gpu_bound = False
        self._read_settings()

    def __repr__(self):
        return f"Runtime(rank {self.rank} of {self.size}, meshes={list(map(str, self._meshes))})"

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc) -> None:
        self.free()

    @staticmethod
    def _prepare_process() -> None:
        """Once per MPI process, when its first runtime is made: pin this rank to its share of the node's
        cores (comm/affinity.py, ``$SPMD_BIND``) and keep freed memory in the heap (exec/heap.py,
        ``$SPMD_HEAP_KEEP``). Simulated worlds (threads of one test process) leave the process alone."""
        bind_to_cores()
        keep_freed_memory()

    @classmethod
    def world(cls) -> "Runtime":
        """The runtime of ``MPI.COMM_WORLD``, made once per process."""
        if cls._world is None:
            cls._world = cls()
        return cls._world

    @classmethod
    def of(cls, comm) -> "Runtime":
        """The runtime for ``comm``: itself if it is one, the world runtime for None, else one per communicator."""
        if isinstance(comm, Runtime):
            return comm
        if comm is None:
            return cls.world()
        held = getattr(comm, "_spmd_runtime", None) or next((r for r in cls._others if r.comm is comm), None)
        if held is None:
            held = cls(comm)
            try:  # Python communicators (the simulated world) carry their runtime and die with it
                comm._spmd_runtime = held
            except AttributeError:  # mpi4py communicators: few and long-lived, kept in a list
                cls._others.append(held)
        return held

    def _read_settings(self) -> None:
        """Read the settings the ranks must share (``AGREED_SETTINGS``) once: when the runtime is made and when it
        unbinds, not per run; each run's preparation then sends only their crc32 (``settings_key``)."""
        self.settings = read_settings()
        self.settings_key = zlib.crc32(repr(sorted(self.settings.items())).encode())

    def checks_inputs(self, check: bool | None = None) -> bool:
        """``check``, or for None ``$SPMD_CHECK_INPUTS`` as read with the settings: whether the values a call
        promises are the same on every rank (global arrays, global batches) are compared by digest."""
        return self.settings[CHECK_ENV] if check is None else bool(check)

    def communicator(self, mesh) -> MeshCommunicator:
        """The MeshCommunicator for ``mesh``, created once. Raises on this rank only: see ``mesh_error``."""
        mc = self._meshes.get(mesh)
        if mc is None:
            mc = self._meshes[mesh] = MeshCommunicator(mesh, self.comm)
        return mc

    def mesh_error(self, mesh) -> str | None:
        if self.size != mesh.size:
            return (f"a program on {mesh} needs one MPI process per mesh device ({mesh.size}); got {self.size} "
                    f"processes")
        return None

    def interpreter(self, program: SPMDProgram, mc: MeshCommunicator, xp) -> Interpreter:
        key = (program.hash, program.mesh, xp.__name__)
        interp = self._interpreters.get(key)
        if interp is None:
            for dtype in {v.dtype for v in (*program.inputs, *program.instrs)}:
                check_backend(xp, dtype)  # CuPy has no bfloat16: refused, not emulated
            interp = self._interpreters[key] = Interpreter(program, mc, xp)
            while len(self._interpreters) > INTERPRETERS_KEPT:
                self._interpreters.popitem(last=False)[1].free()
        else:
            self._interpreters.move_to_end(key)
        return interp

    def array_module(self, backend, xp=None):
        """NumPy or CuPy (``xp``: already resolved from ``backend``); with CuPy each rank binds its GPU
        (node-local rank) once (collective on first use)."""
        xp = xp or get_array_module(backend)
        if is_cupy(xp) and not self._gpu_bound:
            select_device(self.comm)
            self._gpu_bound = True
        return xp

    def unbind(self) -> None:
        """Drop the bound programs, their persistent requests freed (local): the next run binds again, reading
        the binding settings of the environment (``SPMD_PROGRESS``, ``SPMD_PERSISTENT`` ...) anew, and the
        settings the ranks agree on (``AGREED_SETTINGS``) are read anew."""
        self._drop_interpreters()
        self._read_settings()

    def _drop_interpreters(self) -> None:
        for interp in self._interpreters.values():
            interp.free()
        self._interpreters.clear()

    def free(self) -> None:
        """Release the bound programs and every mesh communicator's sub-communicators (collective)."""
        self._drop_interpreters()
        for mesh in list(self._meshes):
            self._meshes.pop(mesh).free()


def communicator(mesh, comm=None) -> MeshCommunicator:
    """The MeshCommunicator for ``mesh`` over ``comm`` (a communicator, a Runtime, or None for the world)."""
    return Runtime.of(comm).communicator(mesh)


def run(program: SPMDProgram, *inputs, comm=None, backend=None, check_inputs=None, profile=None) -> list:
    """Run on every rank with the same global ``inputs`` (pytrees: their leaves in order); returns the global
    outputs (NumPy/CuPy arrays; ``program.out_tree.unflatten(outs)`` restores the traced structure).
    ``profile``: a directory for one Chrome trace per rank (``spmd_runtime.profile``).

    ``check_inputs`` (default True, or ``SPMD_CHECK_INPUTS=0``): the ranks also agree on a digest of each input
    (``comm.agreement.digest``), so ranks passing different global arrays fail, naming the input, instead of
    computing a mix of them.
    """
    inputs = pytree.flatten(inputs)[0]
    rt = Runtime.of(comm)
    error = _local_error(lambda: rt.mesh_error(program.mesh) or _check_global(program, inputs))
    promised = None
    if rt.checks_inputs(check_inputs) and error is None:
        sums, error = capture(digests, inputs)
        promised = Promised("every rank must pass the same global inputs to sr.run",
                            [i.name for i in program.inputs], sums)
    mc, xp = _prepare(rt, program, error, backend, promised)
    mesh, donated = program.mesh, program.donated
    with profiling(profile, "run"):  # a donated input's shard is a copy: the caller's global array stays whole
        outs = _guarded(mc, lambda: _run_checked(rt, program, mc, xp, [
            to_device(shard(x, spec.sharding, mesh, mc.rank, pad=True, own=k in donated), xp)
            for k, (x, spec) in enumerate(zip(inputs, program.inputs))]))
    return _guarded(mc, lambda: [unshard(o, spec.sharding, spec.shape, mc) for o, spec in zip(outs, program.outputs)])


def run_local(program: SPMDProgram, *local_inputs, comm=None, backend=None, profile=None) -> list:
    """Run on this rank's true input blocks (``shard(x, sharding, mesh, rank)``: uneven tails are short);
    returns this rank's true output blocks. Inputs may be pytrees (their leaves in order)."""
    with profiling(profile, "run_local"):
        return run_local_checked(program, pytree.flatten(local_inputs)[0], comm=comm, backend=backend)


def run_local_checked(program: SPMDProgram, local_inputs, comm=None, backend=None, error: str | None = None,
                      promised: "Promised | None" = None):
    """``run_local`` for callers with a check of their own: ``error`` (this rank's) is agreed on with the rest,
    and so are the digests of the values ``promised`` the same on every rank (a global batch)."""
    rt, mesh = Runtime.of(comm), program.mesh
    error = error or _local_error(lambda: rt.mesh_error(mesh) or _check_local(program, local_inputs, rt.rank))
    mc, xp = _prepare(rt, program, error, backend, promised)
    blocks = layout(program, mc.rank)
    outs = _guarded(mc, lambda: _run_checked(rt, program, mc, xp, _owned_donations(program, [
        _pad_to(to_device(x, xp), shape, xp) for x, shape in zip(local_inputs, blocks.padded_inputs)])))
    return [o if cut is None else o[cut] for o, cut in zip(outs, blocks.output_cuts)]


class Layout:
    """One rank's block shapes of a program's inputs and outputs, computed once per (program, rank) (``layout``):
    every run checks, pads and trims with them instead of working each block's bounds out again (a step of a
    60-parameter model has ~120 inputs and outputs)."""
    __slots__ = ("true_inputs", "padded_inputs", "padded_outputs", "output_cuts")

    def __init__(self, program, rank):
        mesh = program.mesh
        true = lambda spec: tuple(s.stop - s.start for s in block_slices(spec.shape, spec.sharding, mesh, rank))
        self.true_inputs = [true(s) for s in program.inputs]
        self.padded_inputs = [tuple(s.sharding.local_shape(s.shape, mesh)) for s in program.inputs]
        self.padded_outputs = [tuple(s.sharding.local_shape(s.shape, mesh)) for s in program.outputs]
        # the slice of each output's padded block that is its true block; None where they are the same
        self.output_cuts = [None if true(s) == padded else tuple(slice(0, n) for n in true(s))
                            for s, padded in zip(program.outputs, self.padded_outputs)]


def layout(program: SPMDProgram, rank: int) -> Layout:
    """``rank``'s Layout of ``program``, made on first use and kept with the program (which never changes)."""
    layouts = program.__dict__.setdefault("_layouts", {})
    found = layouts.get(rank)
    if found is None:
        found = layouts[rank] = Layout(program, rank)
    return found


def _owned_donations(program, local: list) -> list:
    """``local`` with each donated input the program may overwrite as it is: a writeable C-ordered array that
    shares no memory with another input; any other is copied first, with a warning once per program and input
    (writing into it would change another input, or fail)."""
    donated = program.donated
    if not donated:
        return local
    shared, reach, holder = set(), -1, None  # sweep the inputs' byte ranges by start: overlaps share memory
    for (start, end), k in sorted((_span(x), k) for k, x in enumerate(local)):
        if start < reach:
            shared.update((k, holder))
        if end > reach:
            reach, holder = end, k
    out = list(local)
    for k in donated:
        x = local[k]
        why = ("it shares memory with another input" if k in shared else
               "it is not a writeable C-ordered array" if not _writeable(x) else None)
        if why is not None:
            _warn_once((program.hash, k, why), f"donated input {program.inputs[k].name!r} was copied before the "
                                               f"run: {why} (donation writes the program's results into the array "
                                               f"passed)")
            out[k] = _owned(x)
    return out


def _span(x) -> tuple[int, int]:
    """[first byte, end) of the memory ``x`` may touch (host or device, any strides); empty for zero-size."""
    interface = getattr(x, "__cuda_array_interface__", None) or getattr(x, "__array_interface__", None)
    if interface is None or not x.size:
        return (0, 0)
    start = end = interface["data"][0]
    if not interface.get("strides"):  # C-ordered
        return (start, start + x.nbytes)
    for n, stride in zip(x.shape, interface["strides"]):
        (start, end) = (start + stride * (n - 1), end) if stride < 0 else (start, end + stride * (n - 1))
    return (start, end + np.dtype(x.dtype).itemsize)


def _writeable(x) -> bool:
    flags = getattr(x, "flags", None)
    return flags is not None and flags.c_contiguous and getattr(flags, "writeable", True)


def _owned(x):
    """A C-ordered copy of ``x`` that this run owns."""
    return x.copy(order="C") if hasattr(x, "copy") else np.array(x, order="C")


_WARNED: set = set()


def _warn_once(key, message: str) -> None:
    """``message`` as a warning the first time this process meets ``key``."""
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=4)


def block_slices(shape, sharding, mesh, rank) -> tuple[slice, ...]:
    """The global index of ``rank``'s true block of a ``shape`` tensor laid out as ``sharding``."""
    return sharding.block_slices(shape, mesh, rank)


def shard(x, sharding, mesh, rank, pad=False, own=False):
    """This rank's true block of the global array ``x``; ``pad=True`` zero-pads it to the ceil size; ``own``:
    a C-ordered array of its own, never a view of ``x`` (a program may overwrite a donated input's block).
    Partial over some axes (a pending sum): the block on coordinate 0 along them, zeros elsewhere (ones for a
    pending product), so the summands add up to ``x`` (max/min: ``x`` everywhere)."""
    block = x[block_slices(x.shape, sharding, mesh, rank)]
    if sharding.partial and sharding.reduce_op in ("sum", "prod") and mesh.index_along(rank, sharding.partial):
        block = (np.zeros_like if sharding.reduce_op == "sum" else np.ones_like)(block)
    widths = [(0, want - have) for have, want in zip(block.shape, sharding.local_shape(x.shape, mesh))]
    if pad and any(w for _, w in widths):
        return np.pad(block, widths)  # a new array
    return np.array(block, order="C") if own else block


def unshard(local, sharding, shape, mc):
    """The global array from every rank's (padded) block: completes pending reductions (all-reduce), all-gathers
    along each split dim, then trims."""
    if sharding.partial:
        local = collectives.all_reduce(mc, local, sharding.partial, sharding.reduce_op)
    for dim, axes in enumerate(sharding.dims):
        if axes:
            local = collectives.all_gather(mc, local, axes, dim)[(slice(None),) * dim + (slice(0, shape[dim]),)]
    return local


def _pad_to(x, shape, xp):
    if tuple(x.shape) == shape:
        return x
    return xp.pad(x, [(0, want - have) for have, want in zip(x.shape, shape)])


class Promised:
    """Values a call promises are the same on every rank: the rule broken when they are not (says what the
    call needs), their names, and this rank's ``digests`` of them."""
    __slots__ = ("rule", "names", "digests")

    def __init__(self, rule: str, names, digests_: tuple):
        self.rule, self.names, self.digests = rule, list(names), digests_


SKIP = "; check_inputs=False (or SPMD_CHECK_INPUTS=0) skips this check"


def _prepare(rt: Runtime, program, error, backend, promised: Promised | None):
    """(mesh communicator, array module), once every rank is ready: no local error, the same settings
    (``AGREED_SETTINGS``), backend, program and promised values. One allgather; each rank compares every
    rank's view, so all see a difference and raise alike, most basic cause first."""
    xp, failed = capture(get_array_module, backend)
    error = error or failed
    mine = (rt.settings_key, None if xp is None else backend_name(xp), program.hash,
            None if promised is None else promised.digests)
    views = agree(rt.comm, error, "preparing the run", mine)
    if any(view != views[0] for view in views):
        _explain(rt, program, views, promised)
    return rt.communicator(program.mesh), rt.array_module(backend, xp)


def _explain(rt: Runtime, program, views: list, promised: Promised | None) -> None:
    """Raise the error for ranks whose views differ (collective: every rank holds the same ``views``)."""
    if len({v[0] for v in views}) > 1:
        raise AgreedError(settings_difference(rt.comm, rt.settings), list(range(len(views))))
    if len({v[1] for v in views}) > 1:
        raise AgreedError(f"every rank must compute with the same array backend (backend=, $SPMD_BACKEND); got "
                          f"{_by_value([v[1] for v in views])}", list(range(len(views))))
    if len({v[2] for v in views}) > 1:
        raise AgreedError(f"every rank must run the same program; got {program_difference(rt.comm, program)}",
                          list(range(len(views))))
    check_same([v[3] for v in views], promised.names if promised else [], promised.rule if promised else "", SKIP)
    raise AgreedError(f"every rank must prepare the same run; got views {views} by rank (settings key, backend, "
                      f"program hash, digests)", list(range(len(views))))  # none of the above: never blocks


def _by_value(values: list) -> str:
    """"ranks [0, 2]: 'a'; ranks [1]: 'b'" for each rank's value."""
    return "; ".join(f"ranks {ranks}: {value!r}" for value, ranks in ranks_by_value(values).items())


def settings_difference(comm, settings: dict) -> str:
    """Collective (where the ranks' settings keys differ): which settings differ, with each rank's value."""
    every = agree(comm, None, "comparing the ranks' settings", settings)
    differing = [f"{name} ({why}): {_by_value([s[name] for s in every])}"
                 for name, (_, why) in AGREED_SETTINGS.items() if len({repr(s[name]) for s in every}) > 1]
    return ("every rank must run with the same settings (each changes the program, its numerics, or which MPI "
            "calls its collectives make); got different " + "; ".join(differing))


def program_difference(comm, program) -> str:
    """Collective (where the ranks' program hashes differ): the first line where the ranks' listings of their
    programs differ, with each rank's version of it (programs of the same settings and arguments differ when
    the traced function itself depends on the rank)."""
    listings = agree(comm, None, "comparing the ranks' programs",
                     None if program is None else str(program).splitlines()[1:])  # the head line holds the hash
    lines = [listing or [] for listing in listings]
    at = next((k for k in range(max(map(len, lines))) if len({_line(ls, k) for ls in lines}) > 1), 0)
    sizes = {len(ls) for ls in lines}
    sizes = f"{sizes.pop()} lines each" if len(sizes) == 1 else f"lines: {_by_value([len(ls) for ls in lines])}"
    return (f"programs that first differ at line {at + 1} of their listings ({sizes}): "
            f"{_by_value([_line(ls, at) for ls in lines])}")


def _line(lines: list, k: int) -> str:
    text = lines[k].strip() if k < len(lines) else "(end of the listing)"
    return text if len(text) <= 160 else text[:157] + "..."


# ------------------------------------------------------------------ settings every rank must share
CHECK_ENV = "SPMD_CHECK_INPUTS"


def _cost_profile() -> str:
    """The cost model partition() uses when given none: its name and a crc32 of its fits (the profile's path may
    differ between ranks while its contents are the same)."""
    model = resolve_model(None)
    return f"{model.name} #{zlib.crc32(repr(model.fits).encode()):08x}"


def _checks_inputs() -> bool:
    return os.environ.get(CHECK_ENV, "1").strip().lower() not in ("0", "off", "no", "false")


# Each setting that changes the program a rank builds, the numerics of its kernels, or which MPI calls its
# collectives make: a rank differing would compute other bits or block. name -> (read it as its module does,
# why it matters). Read by ``read_settings`` when a Runtime is made or unbinds; agreed in each run's
# preparation. Not here: SPMD_FUSE_BLOCK (elementwise blocks: the same bits), SPMD_PROGRESS (how a rank polls),
# SPMD_BIND, SPMD_HEAP_KEEP, SPMD_TIMEOUT, SPMD_PROFILE, SPMD_DEVICE, SPMD_CUDA_AWARE (where buffers travel, not
# what), SPMD_BACKEND (agreed per run as the backend each rank resolves).
AGREED_SETTINGS = {
    PERSISTENT_ENV: (persistent_enabled, "persistent collectives match only persistent ones"),
    PLAN_ENV: (planning_enabled, "planned buffers decide which collectives are persistent"),
    cpu_kernels.KERNELS_ENV: (cpu_kernels.enabled, "C loops add in another order than NumPy"),
    cpu_kernels.MIN_ENV: (cpu_kernels.min_elements, "which fusions run as C loops"),
    groups.GROUPS_ENV: (groups.groups_enabled, "grouped C loops"),
    fusion.FUSE_ENV: (lambda: fusion.fusion_enabled(None), "the program's fusions"),
    fusion.DUPLICATE_ENV: (fusion.duplicate_enabled, "the program's fusions"),
    schedule.ASYNC_ENV: (lambda: schedule.overlap_enabled(None), "the program's split collectives"),
    schedule.BUDGET_ENV: (lambda: schedule.overlap_budget(None), "the program's split collectives"),
    scan_prefetch.PREFETCH_ENV: (scan_prefetch.prefetch_enabled, "the program's loop prefetches"),
    windowed.WINDOWED_ENV: (lambda: windowed.windowed_threshold(None), "the program's windowed einsums"),
    PROFILE_ENV: (_cost_profile, "the partitioner's choices"),
    CHECK_ENV: (_checks_inputs, "a rank checking its inputs makes an exchange the others must match"),
}


def read_settings() -> dict:
    """Each of ``AGREED_SETTINGS`` as this rank reads it now (an unreadable one as "invalid: <why>": a run
    then fails where that setting is read, or here, if the ranks differ)."""
    values = {}
    for name, (read, _) in AGREED_SETTINGS.items():
        value, error = capture(read)
        values[name] = value if error is None else f"invalid: {error}"
    return values


def _local_error(check) -> str | None:
    """A local check's error message (the one it returns, or the exception it raises), never an exception: it
    must reach the agreement on every rank."""
    message, raised = capture(check)
    return raised or message


def _run_checked(rt, program, mc, xp, local) -> list:
    outs = instrument(rt.interpreter(program, mc, xp)).run(local)
    for o, spec, want in zip(outs, program.outputs, layout(program, mc.rank).padded_outputs):
        if tuple(o.shape) != want or o.dtype != np.dtype(spec.dtype):
            raise RuntimeError(f"output {spec.name!r} of the program must come out as {spec.dtype}{list(want)} "
                               f"on every rank; got {np.dtype(o.dtype).name}{list(o.shape)} (a corrupt program)")
    return outs


def _check_global(program, inputs) -> str | None:
    return _check(program, inputs, lambda spec: spec.shape, "global")


def _check_local(program, inputs, rank) -> str | None:
    return _check(program, inputs, layout(program, rank).true_inputs, "local")


def _check(program, inputs, shapes, kind) -> str | None:
    """The error of the first input that is not an array of its spec's dtype and of the shape in ``shapes`` (a
    function of the spec, or one shape per input)."""
    if len(inputs) != len(program.inputs):
        return (f"the program takes {len(program.inputs)} inputs {[i.name for i in program.inputs]}; "
                f"got {len(inputs)}")
    for k, (x, spec) in enumerate(zip(inputs, program.inputs)):
        want = tuple(shapes(spec)) if callable(shapes) else shapes[k]
        try:
            dtype, shape = np.dtype(x.dtype), tuple(x.shape)
        except Exception as e:  # noqa: BLE001 - no .dtype/.shape, or a dtype NumPy cannot parse
            return (f"{kind} input {spec.name!r} must be an array of {spec.dtype}{list(want)}; got a "
                    f"{type(x).__name__} ({type(e).__name__}: {e})")
        refused = plain_data_error(x, repr(spec.name), f"a {kind} input")
        if refused:
            return refused
        if shape != want or dtype != np.dtype(spec.dtype):
            return f"{kind} input {spec.name!r} must be {spec.dtype}{list(want)}; got {dtype.name}{list(shape)}"
    return None


def _guarded(mc, fn):
    """Run ``fn``; on failure print the rank's error and abort the job so no rank hangs in a collective."""
    try:
        return fn()
    except BaseException as e:  # KeyboardInterrupt too: the peers are, or will be, blocked in a collective
        if mc.comm.Get_size() == 1 or not hasattr(mc.comm, "Abort"):
            raise
        message = f"spmd_runtime: rank {mc.rank} failed, aborting the job:\n{traceback.format_exc()}"
        from mpi4py import MPI  # here, not at the top: importing it initialises MPI (simulated runs need none)
        if isinstance(mc.comm, MPI.Comm):
            jobguard.abort_job(message, mc.comm)  # does not return
        sys.stderr.write(message)  # a simulated world: its Abort raises on every simulated rank
        sys.stderr.flush()
        mc.comm.Abort(1)
        raise e


def _describe_instruction(frame) -> str:
    """Watchdog context: the instruction the interpreter's run loop is executing."""
    interp, slot = frame.f_locals.get("self"), frame.f_locals.get("out")
    ins = next((i for i in getattr(getattr(interp, "program", None), "instrs", ()) if i.out == slot), None)
    if ins is None:
        return "the interpreter's run loop"
    return f"instruction %{slot} = {ins.op}({', '.join(f'{k}={v}' for k, v in ins.attrs.items())})"


watchdog.context(Interpreter.run, _describe_instruction)
