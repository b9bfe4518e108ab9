"""OSU-style latency table: this project's collectives next to the raw mpi4py buffer calls.

Run under MPI:  mpiexec -n 8 python scripts/bench_collectives.py [--quick] [--rounds R] [--row-seconds S]
                [--only all_reduce,permute] [--nonblocking | --unbound] [--device]

For each collective (all_reduce, all_gather, reduce_scatter, all_to_all, and
collective_permute as a ring shift), each message size and each communicator
(the whole world, then each axis of a 2-d mesh (2, N/2)), the project call and
the raw mpi4py call on the same cached sub-communicator with preallocated
buffers (one lambda with the MPI call inline, positional arguments: the
caller's own frame; ours adds the bound closure's) alternate iteration by iteration (which goes first swaps every
iteration), so both see the same machine state. Latency = median over
iterations (as many as fit in ``--row-seconds``, 5 to 1000 per second of it), max over ranks.
The machine is shared and noisy: ``--rounds`` (default 3) passes over every
row, one after another; every round's row is printed as it ends, then a
summary per row: each side's minimum over the rounds and their ratio, and the
paired ratio (per round, the median over iterations of ours / mpi4py within
each back-to-back pair; the summary takes its median over rounds) against
issue 12's target (at most 1.15 at 8 B, 1.02 from 64 KiB up): the pairs cancel
the machine's drift, which the two columns' separate minima do not, and
every round. ``--control`` adds a control column: the raw call against itself
on a second set of buffers, paired the same way, the method's own floor per row
(two identical calls differ by a few per cent on buffer placement alone). The load average and ranks per core (oversubscribed or not)
are printed before and after. The project side is a collective bound once with
``collectives.bind`` (receive buffers kept across calls), as the interpreter
runs it; ``--unbound`` times the one-shot functions instead, ``--nonblocking``
the bound nonblocking ones (``start(x).wait()``, the scheduled programs'
start/done pairs) against mpi4py's nonblocking call and its Wait. Both results are compared
with np.array_equal on every rank.

Size S follows the nccl-tests convention: the output bytes for all_gather, the
input bytes for reduce_scatter, the local buffer otherwise. Bus bandwidth =
S / latency * factor, factor = 2(k-1)/k for all_reduce, (k-1)/k for all_gather,
reduce_scatter and all_to_all, 1 for the permute. Reductions run on float32,
data movement on uint8; sizes are rounded up so each block holds whole elements.

--device puts every buffer on the GPU (CuPy; each rank binds its GPU as the
runner does: SPMD_DEVICE, else node-local rank). The project side moves them
through its Transport; the raw mpi4py side gets the device buffers themselves
when MPI is CUDA-aware (spmd_runtime.comm.gpu.cuda_aware_mpi, SPMD_CUDA_AWARE
overrides), else it stages them by hand through pinned host buffers (cupy
get/set), as the Transport does, so the two columns stay comparable. Both
sides wait for the GPU after each call, and the header says which mode ran.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from spmd_runtime.comm import MeshCommunicator, Transport, collectives
from spmd_runtime.comm.gpu import cuda_aware_mpi
from spmd_runtime.exec.backend import get_array_module, select_device, to_host
from spmd_runtime.mesh import Mesh

WORLD = MPI.COMM_WORLD
FULL_SIZES = [8] + [4**i for i in range(2, 13)]  # 8 B, 16 B, 64 B, ... 16 MiB
QUICK_SIZES = [8, 1024, 65536, 1 << 20]
SECONDS_PER_ROW = 0.2  # iteration budget (--row-seconds): ~200 iterations of small messages, 5 of large ones
MIN_ITERS, MAX_ITERS_PER_SECOND = 5, 1000


class HostBuffers:
    """NumPy buffers; the raw side calls MPI on them as they are."""

    mode = "host buffers (numpy)"
    xp = np

    def put(self, host: np.ndarray):
        return host

    def empty(self, shape, dtype):
        return np.empty(shape, dtype)

    def raw(self, make, send, recv):
        """The zero-argument raw call ``make(send, recv)``: one Python frame around the MPI call, returning ``recv``."""
        return make(send, recv)

    def synced(self, fn):
        return fn


class DeviceBuffers:
    """CuPy buffers on this rank's GPU; the raw side hands them to MPI directly only when MPI is CUDA-aware."""

    def __init__(self, transport: Transport):
        try:
            self.cp = get_array_module("cupy")
            self.gpu = select_device(WORLD)
        except RuntimeError as e:
            raise SystemExit(f"--device needs CuPy and a visible GPU on every rank; got: {e}") from None
        self.cuda_aware = transport.cuda_aware
        how = ("CUDA-aware MPI: device buffers go to MPI directly" if self.cuda_aware else
               "MPI is not CUDA-aware: both sides stage through pinned host buffers")
        self.mode = f"device buffers (cupy, GPU {self.gpu}); {how}"

    @property
    def xp(self):
        return self.cp

    def put(self, host: np.ndarray):
        return self.cp.asarray(host)

    def empty(self, shape, dtype):
        return self.cp.empty(shape, dtype)

    def sync(self) -> None:
        self.cp.cuda.get_current_stream().synchronize()

    def raw(self, make, send, recv):
        if self.cuda_aware:
            direct = make(send, recv)
            return lambda: (self.sync(), direct())[1]
        host_send, host_recv = self.pinned_like(send), self.pinned_like(recv)
        mpi_call = make(host_send, host_recv)

        def staged():
            send.get(out=host_send)  # blocking: waits for the kernels that wrote `send`
            mpi_call()
            recv.set(host_recv)
            return recv
        return staged

    def pinned_like(self, a) -> np.ndarray:
        memory = self.cp.cuda.alloc_pinned_memory(max(a.nbytes, 1))
        return np.frombuffer(memory, a.dtype, a.size).reshape(a.shape)

    def synced(self, fn):
        """``fn`` followed by a wait for the GPU, so each timed call includes its device work."""
        return lambda: (fn(), self.sync())[0]


BUF = HostBuffers()  # main() swaps in DeviceBuffers for --device
UNBOUND = False  # main() sets it for --unbound
NONBLOCKING = False  # main() sets it for --nonblocking
CONTROL = False  # main() sets it for --control


def round_up(n: int, multiple: int) -> int:
    return max(multiple, -(-n // multiple) * multiple)


def ours(mc, kind, x, **attrs):
    """The project call as the interpreter makes it: bound once, then called on the step's array, which is
    the same array every call (the interpreter's planned buffer): a persistent request on host buffers unless
    ``SPMD_PERSISTENT=0``.
    ``--unbound`` times the one-shot function API (``collectives.all_reduce(mc, x, ...)``) instead."""
    if UNBOUND:
        fn = getattr(collectives, kind)
        return lambda: fn(mc, x, **attrs)
    bound = collectives.bind(mc, kind, BUF.xp, x.shape, x.dtype, nonblocking=NONBLOCKING, operand=x, **attrs)
    return (lambda: bound(x).wait()) if NONBLOCKING else lambda: bound(x)


def raw_call(blocking, nonblocking):
    """The raw mpi4py side, ``make(send, recv) -> zero-argument call returning recv``: the blocking call, or with
    ``--nonblocking`` the nonblocking one and its wait. Each is one lambda with the MPI call written inline
    (methods looked up once, arguments positional): what a caller of mpi4py writes at its best."""
    return nonblocking if NONBLOCKING else blocking


def case_all_reduce(mc, axes, nbytes, rng):
    k, x = mc.axis_size(axes), BUF.put(rng.standard_normal(max(1, nbytes // 4)).astype(np.float32))
    sub, recv = mc.sub(axes), BUF.empty(x.shape, x.dtype)
    allreduce, iallreduce, op = sub.Allreduce, sub.Iallreduce, MPI.SUM
    raw = BUF.raw(raw_call(lambda s, r: lambda: (allreduce(s, r, op), r)[1],
                           lambda s, r: lambda: (iallreduce(s, r, op).Wait(), r)[1]), x, recv)
    return ours(mc, "all_reduce", x, axes=axes, op="sum"), raw, x.nbytes, 2 * (k - 1) / k


def case_all_gather(mc, axes, nbytes, rng):
    k = mc.axis_size(axes)
    x = BUF.put(rng.integers(0, 255, round_up(nbytes, k) // k, dtype=np.uint8))
    sub, recv = mc.sub(axes), BUF.empty(k * x.size, np.uint8)
    allgather, iallgather = sub.Allgather, sub.Iallgather
    raw = BUF.raw(raw_call(lambda s, r: lambda: (allgather(s, r), r)[1],
                           lambda s, r: lambda: (iallgather(s, r).Wait(), r)[1]), x, recv)
    return ours(mc, "all_gather", x, axes=axes, dim=0), raw, recv.nbytes, (k - 1) / k


def case_reduce_scatter(mc, axes, nbytes, rng):
    k = mc.axis_size(axes)
    x = BUF.put(rng.standard_normal(round_up(nbytes // 4, k)).astype(np.float32))
    sub, recv = mc.sub(axes), BUF.empty(x.size // k, np.float32)
    reduce_scatter, ireduce_scatter, op = sub.Reduce_scatter_block, sub.Ireduce_scatter_block, MPI.SUM
    raw = BUF.raw(raw_call(lambda s, r: lambda: (reduce_scatter(s, r, op), r)[1],
                           lambda s, r: lambda: (ireduce_scatter(s, r, op).Wait(), r)[1]), x, recv)
    return ours(mc, "reduce_scatter", x, axes=axes, dim=0, op="sum"), raw, x.nbytes, (k - 1) / k


def case_all_to_all(mc, axes, nbytes, rng):
    k = mc.axis_size(axes)
    x = BUF.put(rng.integers(0, 255, round_up(nbytes, k), dtype=np.uint8))
    sub, recv = mc.sub(axes), BUF.empty(x.shape, x.dtype)
    alltoall, ialltoall = sub.Alltoall, sub.Ialltoall
    raw = BUF.raw(raw_call(lambda s, r: lambda: (alltoall(s, r), r)[1],
                           lambda s, r: lambda: (ialltoall(s, r).Wait(), r)[1]), x, recv)
    return ours(mc, "all_to_all", x, axes=axes, split_dim=0, concat_dim=0), raw, x.nbytes, (k - 1) / k


def case_permute(mc, axes, nbytes, rng):
    # Ring shift inside each group along `axes`, in world ranks.
    pairs = [(g[i], g[(i + 1) % len(g)]) for g in mc.mesh.groups(axes) for i in range(len(g))]
    dest = dict(pairs)[mc.rank]
    source = {d: s for s, d in pairs}[mc.rank]
    x = BUF.put(rng.integers(0, 255, nbytes, dtype=np.uint8))
    recv = BUF.empty(x.shape, x.dtype)
    sendrecv, irecv, isend, waitall = mc.comm.Sendrecv, mc.comm.Irecv, mc.comm.Isend, MPI.Request.Waitall
    raw = BUF.raw(raw_call(lambda s, r: lambda: (sendrecv(s, dest, 0, r, source, 0), r)[1],
                           lambda s, r: lambda: (waitall([irecv(r, source, 0), isend(s, dest, 0)]), r)[1]), x, recv)
    return ours(mc, "collective_permute", x, pairs=pairs), raw, x.nbytes, 1.0


CASES = {"all_reduce": case_all_reduce, "all_gather": case_all_gather, "reduce_scatter": case_reduce_scatter,
         "all_to_all": case_all_to_all, "permute": case_permute}


def iterations_for(ours, raw) -> int:
    """Iterations filling SECONDS_PER_ROW, from one warm-up round; the same on every rank."""
    start = time.perf_counter()
    ours(), raw()
    pair_seconds = WORLD.allreduce(time.perf_counter() - start, MPI.MAX)
    most = MAX_ITERS_PER_SECOND * SECONDS_PER_ROW
    return int(min(most, max(MIN_ITERS, SECONDS_PER_ROW / max(pair_seconds, 1e-9))))


def time_side_by_side(ours, raw, iters: int) -> tuple[float, float, float]:
    """Median seconds per call of each, alternating calls; the slowest rank's median; and the paired ratio:
    the median over iterations of ours / mpi4py within each iteration's pair (the two calls run back to back,
    so the machine's drift, seconds long, cancels), the largest over ranks.
    Which side goes first swaps every iteration: the second call of a pair starts where the first left the
    ranks (one may still be finishing), so a fixed order would favour one side."""
    WORLD.Barrier()
    perf_counter, t_ours, t_raw = time.perf_counter, [], []
    for i in range(iters):
        first, second = (ours, raw) if i % 2 == 0 else (raw, ours)
        t0 = perf_counter()
        first()
        t1 = perf_counter()
        second()
        t2 = perf_counter()
        (t_ours if i % 2 == 0 else t_raw).append(t1 - t0)
        (t_raw if i % 2 == 0 else t_ours).append(t2 - t1)
    paired = statistics.median(o / r for o, r in zip(t_ours, t_raw))
    return (WORLD.allreduce(statistics.median(t_ours), MPI.MAX), WORLD.allreduce(statistics.median(t_raw), MPI.MAX),
            WORLD.allreduce(paired, MPI.MAX))


def identical(ours, raw) -> bool:
    """Same bytes from both on every rank (the raw result is copied: its buffer is reused)."""
    mine, theirs = to_host(ours()), to_host(raw()).copy()
    return bool(WORLD.allreduce(mine.shape == theirs.shape and np.array_equal(mine, theirs), MPI.LAND))


def bench_mesh(n: int) -> Mesh:
    a = 2 if n % 2 == 0 else n
    return Mesh((a, n // a), ("x", "y"))


def communicators(mesh: Mesh) -> list[tuple[str, tuple[str, ...]]]:
    """(label, axes): the whole world, then each mesh axis with more than one device."""
    out = [(f"world({mesh.size})", mesh.axis_names)]
    out += [(f"{a}({mesh.axis_size(a)})", (a,)) for a in mesh.axis_names if 1 < mesh.axis_size(a) < mesh.size]
    return out


def fmt_size(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


HEADER = f"{'collective':<15}{'comm':<10}{'size':>10}{'ours us':>12}{'mpi4py us':>12}{'ratio':>8}{'paired':>8}"


def target(nbytes: int) -> float | None:
    """Issue 12's bound on ours / mpi4py: 1.15 at 8 B, 1.02 from 64 KiB up (none in between)."""
    return 1.15 if nbytes <= 8 else 1.02 if nbytes >= 64 << 10 else None


def bench_row(name, mc, axes, label, nbytes, rng, round_no) -> tuple[float, float, int, float, bool]:
    """Time one (collective, communicator, size) row, print it with its round; (ours s, raw s, size, factor, same)."""
    ours, raw, size, factor = CASES[name](mc, axes, nbytes, rng)
    ours, raw = BUF.synced(ours), BUF.synced(raw)
    ours(), raw()  # warm-up: first-touch page faults, MPI connection setup
    iters = iterations_for(ours, raw)
    t_ours, t_raw, paired = time_side_by_side(ours, raw, iters)
    same = identical(ours, raw)
    control = None
    if CONTROL:  # the same raw call against itself on other buffers: the method's own floor for this row
        _, raw2, *_ = CASES[name](mc, axes, nbytes, rng)
        raw2 = BUF.synced(raw2)
        raw2()
        control = time_side_by_side(raw2, raw, iters)[2]
    report(f"{name:<15}{label:<10}{fmt_size(size):>10}{t_ours * 1e6:>12.1f}{t_raw * 1e6:>12.1f}"
           f"{t_ours / t_raw:>8.2f}{paired:>8.3f}{'' if control is None else f'{control:>9.3f}'}  round {round_no}"
           f"{'' if same else '  RESULTS DIFFER'}")
    return t_ours, t_raw, size, factor, same, paired, control


def summary(rows, times) -> str:
    """Per row: the minimum over rounds of each side and their ratio; the median over rounds of the paired ratio
    (each round's median of ours / mpi4py within a pair), which the target is judged on, as the pairs cancel
    the drift between rounds and rows that the minima of two separate columns keep; every round. ``--control`` adds a control column: the raw call against itself
on a second set of buffers, paired the same way, the method's own floor per row
(two identical calls differ by a few per cent on buffer placement alone)."""
    lines = [f"{HEADER}{'control' if CONTROL else ''}{'busbw GB/s':>12}  target (paired)  "
             f"rounds (ours/mpi4py us, paired{', control' if CONTROL else ''})"]
    for (name, _, label, _), runs in zip(rows, times):
        t_ours, t_raw = min(t for t, *_ in runs), min(t for _, t, *_ in runs)
        size, factor, ratio = runs[0][2], runs[0][3], t_ours / t_raw
        paired = statistics.median(run[5] for run in runs)
        control = f"{statistics.median(run[6] for run in runs):>9.3f}" if CONTROL else ""
        bound = target(size)
        verdict = "-" if bound is None else f"{'ok' if paired <= bound else 'OVER'} {bound:.2f}"
        every = " ".join(f"{o * 1e6:.1f}/{r * 1e6:.1f},{p:.3f}" + (f",{c:.3f}" if CONTROL else "")
                         for o, r, _, _, _, p, c in runs)
        lines.append(f"{name:<15}{label:<10}{fmt_size(size):>10}{t_ours * 1e6:>12.1f}{t_raw * 1e6:>12.1f}"
                     f"{ratio:>8.2f}{paired:>8.3f}{control}{size / t_ours * factor / 1e9:>12.3f}  {verdict:<16}{every}")
    return "\n".join(lines)


def machine_state(when: str) -> str:
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    cores = len(os.sched_getaffinity(0))
    crowded = ", OVERSUBSCRIBED (more ranks than cores)" if WORLD.Get_size() > cores else ""
    return f"# {when}: load average {load}; {WORLD.Get_size()} ranks on {cores} cores{crowded}"


def mpich_settings() -> str:
    """The MPIR_CVAR_* variables this run was given (yield / polling settings matter when oversubscribed)."""
    return " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MPIR_CVAR_")) or "none"


def run(sizes: list[int], rounds: int, device: bool = False, only=tuple(CASES)) -> bool:
    global BUF
    # One CUDA-awareness answer for both sides: the Transport's is the one the raw side follows.
    transport = Transport(cuda_aware=cuda_aware_mpi() if device else None)
    mc = MeshCommunicator(bench_mesh(WORLD.Get_size()), transport=transport)
    BUF = DeviceBuffers(transport) if device else HostBuffers()
    rng = np.random.default_rng(WORLD.Get_rank())
    report(f"# {WORLD.Get_size()} ranks, mesh {mc.mesh}, {MPI.Get_library_version().splitlines()[0]}\n"
           f"# {BUF.mode}; ours = {'one-shot functions' if UNBOUND else 'collectives bound once (the interpreter)'}"
           f"{'; nonblocking: start + wait against the I-call + Wait' if NONBLOCKING else ''}"
           f"\n{machine_state('before')}\n"
           f"# {rounds} rounds over every row, {SECONDS_PER_ROW:g} s per row; in each row ours and mpi4py alternate "
           f"call by call, median per side\n# MPICH settings from the environment: {mpich_settings()}"
           f"\n{HEADER}")
    rows = [(name, axes, label, nbytes) for name in only for label, axes in communicators(mc.mesh) for nbytes in sizes]
    times = [[] for _ in rows]
    for round_no in range(1, rounds + 1):
        for row, runs in zip(rows, times):
            name, axes, label, nbytes = row
            runs.append(bench_row(name, mc, axes, label, nbytes, rng, round_no))
    all_same = all(same for runs in times for _, _, _, _, same, _, _ in runs)
    report(f"# summary: minimum over {rounds} rounds of each side's median, and the median over rounds of the paired ratio"
           f"\n{summary(rows, times)}\n"
           f"# results identical to mpi4py on every row: {'yes' if all_same else 'NO'}\n{machine_state('after')}")
    mc.free()
    return all_same


def report(line: str) -> None:
    if WORLD.Get_rank() == 0:
        print(line, flush=True)


def main() -> None:
    global UNBOUND, SECONDS_PER_ROW, NONBLOCKING, CONTROL
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"only sizes {QUICK_SIZES}")
    parser.add_argument("--device", action="store_true",
                        help="buffers on the GPU (CuPy); the raw side stages through host memory unless MPI is "
                             "CUDA-aware")
    parser.add_argument("--only", default=",".join(CASES),
                        help=f"comma-separated collectives to time (default all: {','.join(CASES)})")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds over every row; the summary takes each side's minimum over them (default 3)")
    parser.add_argument("--row-seconds", type=float, default=SECONDS_PER_ROW,
                        help=f"time budget of one row in one round (default {SECONDS_PER_ROW}); more steadies the "
                             "medians of an oversubscribed run")
    parser.add_argument("--unbound", action="store_true",
                        help="time the one-shot functions (bind + call every time) instead of bound collectives")
    parser.add_argument("--nonblocking", action="store_true",
                        help="bound nonblocking collectives (the scheduled programs' start/done pairs: start(x).wait())"
                             " against mpi4py's Iallreduce ... + Wait (Irecv + Isend + Waitall for the permute)")
    parser.add_argument("--control", action="store_true",
                        help="also time the raw call against itself on a second set of buffers, paired as above: "
                             "the method's floor per row (where buffer placement alone moves latency a few %%)")
    args = parser.parse_args()
    only = tuple(args.only.split(","))
    if not only or any(name not in CASES for name in only):
        parser.error(f"--only takes collectives from {list(CASES)}; got {args.only!r}")
    if args.unbound and args.nonblocking:
        parser.error("--unbound times the one-shot functions, which are blocking; got --unbound with --nonblocking")
    if args.rounds < 1 or args.row_seconds <= 0:
        parser.error(f"--rounds must be at least 1 and --row-seconds positive; got {args.rounds} and "
                     f"{args.row_seconds}")
    UNBOUND, SECONDS_PER_ROW, NONBLOCKING, CONTROL = args.unbound, args.row_seconds, args.nonblocking, args.control
    start = time.perf_counter()
    ok = run(QUICK_SIZES if args.quick else FULL_SIZES, args.rounds, device=args.device, only=only)
    report(f"# total {time.perf_counter() - start:.1f} s")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
