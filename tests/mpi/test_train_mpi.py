"""Training under real MPI, for any world size: a 2-step run of the partitioned LM training step on
every 1-d and 2-d mesh of the world (plus one with reordered devices) matches the unpartitioned
reference, and a checkpoint saved on one mesh resumes the same loss curve on another. From 3 ranks up each
2-d preset runs on one mesh (2x2 at 4 ranks, one of 2x4 / 4x2 at 8) and a sample of the rest (``sample_at_large_world``, tests/mpi/conftest.py).

Run: ``mpiexec -n N python -m pytest --with-mpi tests/mpi/test_train_mpi.py -p no:cacheprovider``.
Rank 0 traces and partitions (``build_train_step_on_root``) and computes the reference; assertions come
after all collectives so one failing rank cannot hang the rest.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

from spmd_runtime import pytree
from spmd_runtime.mesh import Mesh
from spmd_runtime.models.lm import LMConfig
from spmd_runtime.optim import AdamW
from spmd_runtime.train import build_train_step_on_root, train_mesh

from mesh_cases import splits_two_axes

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
N = WORLD.Get_size()
CFG = LMConfig(layers=1, d=16, heads=4, ffn=32, vocab=24, seq=8, batch=8, dtype="float64")
OPT = AdamW(lr=1e-2, weight_decay=0.1)


def cases() -> list[tuple[tuple, str, bool]]:
    """(mesh shape, preset, reversed devices): 1-d meshes with the 1-d presets, 2-d ones with the 2-d."""
    out = [((N,), p, False) for p in ("dp", "wus", "seq", "megatron", "fsdp")]
    pairs = [(a, N // a) for a in range(2, N) if N % a == 0]
    for shape in pairs:
        out += [(shape, p, False) for p in ("megatron_wus", "dp_seq", "megatron", "fsdp_megatron")]
    if pairs:
        out.append((pairs[len(pairs) // 2], "megatron_wus", True))
    return out


def mesh_of(shape, preset, reverse) -> Mesh:
    mesh = train_mesh(shape, preset)
    return Mesh(mesh.shape, mesh.axis_names, tuple(reversed(range(N)))) if reverse else mesh


def feed(n, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, CFG.vocab, (CFG.batch, CFG.seq)), rng.integers(0, CFG.vocab, (CFG.batch, CFG.seq)))
            for _ in range(n)]


def reference(ts, state, batches):
    losses = []
    for x, y in batches:
        state, loss = ts.reference_step(state, x, y)
        losses.append(loss)
    return state, losses


def train(ts, local, batches):
    losses = []
    for x, y in batches:
        local, loss = ts.step(local, x, y, comm=WORLD)
        losses.append(loss)
    return local, losses


@pytest.mark.parametrize("shape,preset,reverse", cases(),
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
@pytest.mark.sample_at_large_world(group=lambda shape, preset, reverse: f"{len(shape)}-d {preset}",
                                   specific=lambda shape, preset, reverse: splits_two_axes(shape))
def test_two_steps_match_the_reference(shape, preset, reverse):
    ts = build_train_step_on_root(CFG, mesh_of(shape, preset, reverse), preset, OPT, WORLD)
    state, data = ts.init(seed=1), feed(2)
    want = WORLD.bcast(reference(ts, state, data) if WORLD.Get_rank() == 0 else None, root=0)
    local, losses = train(ts, ts.shard_state(state, WORLD.Get_rank()), data)
    got = ts.gather(local, WORLD)
    all_losses = WORLD.allgather(losses)
    got, want_state = ts.named(got), ts.named(want[0])
    for name in want_state:
        np.testing.assert_allclose(got[name], want_state[name], rtol=1e-9, atol=1e-12, err_msg=name)
    for rank_losses in all_losses:
        np.testing.assert_allclose(rank_losses, want[1], rtol=1e-12)


def overlap_cases() -> list[tuple[tuple, str, bool]]:
    """One case of the table above (the suite's time): Megatron with weight-update sharding on the first 2-d
    mesh (all-reduces, reduce-scatters and all-gathers split), or 1-d Megatron where the world is prime.
    Every case of the table runs scheduled (the default) in ``test_two_steps_match_the_reference``."""
    table = cases()
    return [next((c for c in table if c[1] == "megatron_wus"), ((N,), "megatron", False))]


@pytest.mark.parametrize("shape,preset,reverse", overlap_cases(),
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_overlapped_step_equals_the_blocking_step(shape, preset, reverse, monkeypatch):
    """Start/done pairs run with MPI's nonblocking collectives (partition/schedule.py): the same bits as the
    blocking program, at every world size."""
    mesh = mesh_of(shape, preset, reverse)
    overlapped = build_train_step_on_root(CFG, mesh, preset, OPT, WORLD)
    monkeypatch.setenv("SPMD_ASYNC", "0")
    blocking = build_train_step_on_root(CFG, mesh, preset, OPT, WORLD)
    split = sum(i.op.endswith("_start") for i in overlapped.program.instrs)
    state, data = overlapped.init(seed=1), feed(2)
    got, got_losses = train(overlapped, overlapped.shard_state(state, WORLD.Get_rank()), data)
    want, want_losses = train(blocking, blocking.shard_state(state, WORLD.Get_rank()), data)
    assert N == 1 or split > 0, "the scheduler split no collective"
    assert not any(i.op.endswith("_start") for i in blocking.program.instrs)
    assert got_losses == want_losses
    for g, w, io in zip(pytree.flatten(got)[0], pytree.flatten(want)[0], overlapped.program.inputs, strict=False):
        np.testing.assert_array_equal(g, w, err_msg=io.name)


def _persistent_bindings() -> int:
    """How many bound collectives of the programs bound on WORLD start MPI-4 persistent requests."""
    from spmd_runtime.exec.runner import Runtime
    return sum(bool(getattr(fn, "persistent_requests", ())) for interp in Runtime.of(WORLD)._interpreters.values() for _, fn, _, _ in interp.bound)


def test_persistent_collectives_give_the_bits_of_plain_calls(monkeypatch):
    """Collectives on planned operands run as persistent requests (``Allreduce_init`` ..., set up once when the
    program is bound); ``$SPMD_PERSISTENT=0`` binds the plain calls: two steps give the same bits either way.
    Megatron: its forward all-reduces reduce planned buffers in place (dp's gradients become the new weights,
    outputs, so they are not planned)."""
    from spmd_runtime.exec.runner import Runtime
    ts = build_train_step_on_root(CFG, mesh_of((N,), "megatron", False), "megatron", OPT, WORLD)
    state, data = ts.init(seed=1), feed(2)
    results = {}
    for persistent in ("0", "1"):
        monkeypatch.setenv("SPMD_PERSISTENT", persistent)
        Runtime.of(WORLD).unbind()  # bind the program again under this setting
        results[persistent] = (*train(ts, ts.shard_state(state, WORLD.Get_rank()), data), _persistent_bindings())
    (plain, plain_losses, none), (got, got_losses, made) = results["0"], results["1"]
    assert none == 0
    assert N == 1 or made > 0, "no collective of the step was bound to a persistent request"
    assert got_losses == plain_losses
    for g, w in zip(pytree.flatten(got)[0], pytree.flatten(plain)[0]):
        np.testing.assert_array_equal(g, w)


def test_stacking_in_place_gives_the_bits_of_copying_the_stacked_results(monkeypatch):
    """A scanned, donating dp step writes each layer's gradients, all-reduced in place on persistent requests
    set up on the stacked arrays, straight into them (exec/loops.py); the same step copying every stacked
    result gives the same bits."""
    from spmd_runtime.exec import loops
    from spmd_runtime.exec.runner import Runtime
    cfg = LMConfig(layers=2, d=16, heads=4, ffn=32, vocab=24, seq=8, batch=8, scan_layers=True)
    ts = build_train_step_on_root(cfg, mesh_of((N,), "dp", False), "dp", OPT, WORLD, donate=True)
    state, data = ts.init(seed=1), feed(2)
    results = []
    for written in (loops._written_in_place, lambda body, nc: {}):
        monkeypatch.setattr(loops, "_written_in_place", written)
        Runtime.of(WORLD).unbind()  # bind the program again with this stacking
        results.append(train(ts, ts.shard_state(state, WORLD.Get_rank()), data))
    Runtime.of(WORLD).unbind()
    (direct, direct_losses), (copied, copied_losses) = results
    assert direct_losses == copied_losses
    for d, c in zip(pytree.flatten(direct)[0], pytree.flatten(copied)[0]):
        np.testing.assert_array_equal(d, c)


@pytest.mark.parametrize("preset", ["dp", "fsdp"])
def test_a_donating_step_equals_the_plain_step(preset, monkeypatch):
    """``build_train_step(donate=True)``: the state updated in its own buffers, under real MPI: the same bits as
    the plain step over two steps; data-parallel gradients are then planned, so their all-reduces run as
    persistent requests."""
    from spmd_runtime.exec.runner import Runtime
    mesh = mesh_of((N,), preset, False)
    plain = build_train_step_on_root(CFG, mesh, preset, OPT, WORLD)
    donating = build_train_step_on_root(CFG, mesh, preset, OPT, WORLD, donate=True)
    state, data = plain.init(seed=1), feed(2)
    want, want_losses = train(plain, plain.shard_state(state, WORLD.Get_rank()), data)
    Runtime.of(WORLD).unbind()
    got, got_losses = train(donating, donating.shard_state(state, WORLD.Get_rank()), data)
    persistent = _persistent_bindings()
    assert got_losses == want_losses
    for g, w in zip(pytree.flatten(got)[0], pytree.flatten(want)[0]):
        np.testing.assert_array_equal(g, w)
    assert N == 1 or preset != "dp" or persistent > 0, "dp's gradient all-reduces should be persistent"


@pytest.mark.parametrize("preset", ["dp", "megatron"])
@pytest.mark.sample_at_large_world()
def test_an_accumulating_donating_step_equals_the_plain_step(preset):
    """Two micro-batches over scanned layers with the state donated: the accumulators are updated in place by
    the micro-batch scan's body (in the loop's own buffers) and every parameter in its donated buffer, under
    real MPI: the same bits as the plain accumulating step over two steps. (fsdp over scanned layers refuses
    micro-batches, tests/unit/test_train.py: it ran the whole batch, so its case here compared nothing.)"""
    from spmd_runtime.exec.runner import Runtime
    cfg, mesh = LMConfig(**{**CFG.__dict__, "layers": 2}), mesh_of((N,), preset, False)
    plain = build_train_step_on_root(cfg, mesh, preset, OPT, WORLD, microbatches=2)
    donating = build_train_step_on_root(cfg, mesh, preset, OPT, WORLD, microbatches=2, donate=True)
    assert any(i.attrs["body"].written_inputs for i in donating.program.instrs if i.op == "scan")  # accumulators
    state, data = plain.init(seed=1), feed(2)
    want, want_losses = train(plain, plain.shard_state(state, WORLD.Get_rank()), data)
    Runtime.of(WORLD).unbind()
    got, got_losses = train(donating, donating.shard_state(state, WORLD.Get_rank()), data)
    assert got_losses == want_losses
    for g, w in zip(pytree.flatten(got)[0], pytree.flatten(want)[0]):
        np.testing.assert_array_equal(g, w)


PREFETCH_CFG = LMConfig(layers=3, d=16, heads=4, ffn=32, vocab=24, seq=8, batch=8, dtype="float64", remat="full")


def test_prefetched_scan_equals_the_plain_step(monkeypatch):
    """Cross-iteration prefetch (partition/scan_prefetch.py, ``$SPMD_SCAN_PREFETCH=1``): FSDP's gathers of the
    next layer in flight across each iteration of both scans, under real MPI: the same bits as without."""
    mesh = train_mesh((N,), "fsdp")
    plain = build_train_step_on_root(PREFETCH_CFG, mesh, "fsdp", OPT, WORLD)
    monkeypatch.setenv("SPMD_SCAN_PREFETCH", "1")
    piped = build_train_step_on_root(PREFETCH_CFG, mesh, "fsdp", OPT, WORLD)
    gathers = any(i.op == "all_gather_start" for s in plain.program.instrs if s.op == "scan"
                  for i in s.attrs["body"].instrs)
    shifted = any(any(s.attrs.get("shifts", ())) for s in piped.program.instrs if s.op == "scan")
    state, data = plain.init(seed=1), feed(2)
    got, got_losses = train(piped, piped.shard_state(state, WORLD.Get_rank()), data)
    want, want_losses = train(plain, plain.shard_state(state, WORLD.Get_rank()), data)
    assert shifted == gathers  # every world whose shards the weights split prefetches
    assert got_losses == want_losses
    for g, w in zip(pytree.flatten(got)[0], pytree.flatten(want)[0]):
        np.testing.assert_array_equal(g, w)


@pytest.fixture
def shared_dir():
    path = WORLD.bcast(tempfile.mkdtemp(prefix="spmd_train_") if WORLD.Get_rank() == 0 else None, root=0)
    yield os.path.join(path, "ckpt")
    WORLD.Barrier()
    if WORLD.Get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def test_checkpoint_resumes_the_loss_curve_on_another_mesh(shared_dir):
    pairs = [(a, N // a) for a in range(2, N) if N % a == 0]
    first = build_train_step_on_root(CFG, train_mesh(pairs[0] if pairs else (N,), "megatron_wus"), "megatron_wus",
                                     OPT, WORLD)
    second = build_train_step_on_root(CFG, train_mesh((N,), "wus"), "wus", OPT, WORLD)
    data, start = feed(3, seed=2), first.init(seed=2)
    _, straight = train(first, first.shard_state(start, WORLD.Get_rank()), data)
    local, head = train(first, first.shard_state(start, WORLD.Get_rank()), data[:1])
    first.save(shared_dir, local, step=1, comm=WORLD)
    saved = first.gather(local, WORLD)
    reloaded = second.load(shared_dir, comm=WORLD)
    restored = second.gather(reloaded, WORLD)
    _, tail = train(second, reloaded, data[1:])
    restored, saved = second.named(restored), first.named(saved)
    assert list(restored) == list(saved)
    for name in saved:
        assert np.array_equal(restored[name], saved[name]), name
    np.testing.assert_allclose(head + tail, straight, rtol=1e-12)


# ---------------------------------------------------------------- GShard mixture of experts
MOE_CFG = LMConfig(layers=2, d=16, heads=4, ffn=64, vocab=24, seq=8, batch=8, dtype="float64", moe_every=2,
                   experts=8, capacity_factor=1.0)


def moe_cases() -> list[tuple[tuple, str]]:
    """One case per world size (8 ranks are slow): the whole world as the expert axis, or (when N factors)
    experts on the first axis of the last factorisation, with the expert hidden dim on the second at 4 ranks."""
    pairs = [(a, N // a) for a in range(2, N) if N % a == 0]
    return [(pairs[-1], "moe_megatron" if N == 4 else "moe")] if pairs else [((N,), "moe")]


@pytest.mark.skipif(N < 2, reason="expert parallelism needs 2 or more ranks")
@pytest.mark.parametrize("shape,preset", moe_cases(), ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple)
                         else str(v))
def test_moe_two_steps_match_the_reference(shape, preset):
    ts = build_train_step_on_root(MOE_CFG, train_mesh(shape, preset), preset, OPT, WORLD)
    rng = np.random.default_rng(3)
    data = [(rng.integers(0, 24, (8, 8)), rng.integers(0, 24, (8, 8))) for _ in range(2)]
    state = ts.init(seed=1)
    want = WORLD.bcast(reference(ts, state, data) if WORLD.Get_rank() == 0 else None, root=0)
    local, losses = train(ts, ts.shard_state(state, WORLD.Get_rank()), data)
    got = ts.gather(local, WORLD)
    all_losses = WORLD.allgather(losses)
    got, want_state = ts.named(got), ts.named(want[0])
    for name in want_state:
        np.testing.assert_allclose(got[name], want_state[name], rtol=1e-8, atol=1e-10, err_msg=name)
    for rank_losses in all_losses:
        np.testing.assert_allclose(rank_losses, want[1], rtol=1e-7)  # gating (aux loss) runs in float32
    assert sum(g["count"] for g in ts.comm_summary() if g["kind"].startswith("all_to_all")) == 4


# ---------------------------------------------------------------- GSPMD pipelining
PIPE_CFG = LMConfig(layers=4, d=16, heads=4, ffn=32, vocab=24, seq=8, batch=8, dtype="float64")


@pytest.mark.skipif(N != 8, reason="the pipeline meshes (stage=2, data=2, model=2) and (stage=4, data=2) need 8 ranks")
@pytest.mark.parametrize("preset", ["pipeline", "pipeline_1f1b"])
@pytest.mark.parametrize("shape,microbatches,tied", [((2, 2, 2), 2, True), ((4, 2), 4, False)],
                         ids=["2x2x2-tied", "4x2"])
def test_pipeline_loss_curve_matches_the_reference(shape, microbatches, tied, preset):
    """Three steps of the pipeline presets follow the unpartitioned step of the same (scanned) model, and each
    rank holds 1/S of the layer parameters, and 1/S of those outside the layers too (embedding, positional table,
    final LayerNorm, head: split over the stages, gathered where used)."""
    cfg = LMConfig(**{**PIPE_CFG.__dict__, "tied": tied})
    ts = build_train_step_on_root(cfg, train_mesh(shape, preset), preset, OPT, WORLD, microbatches)
    plain = build_train_step_on_root(cfg, train_mesh((N,), "dp"), "dp", OPT, WORLD)
    state, data = ts.init(seed=1), feed(1) * 3  # one batch three times: the loss falls
    want = WORLD.bcast(reference(plain, state, data) if WORLD.Get_rank() == 0 else None, root=0)
    local, losses = train(ts, ts.shard_state(state, WORLD.Get_rank()), data)
    got = ts.gather(local, WORLD)
    all_losses = WORLD.allgather(losses)
    blocks = ts.named(local)
    layer_blocks = [(blocks[io.name].shape, io.shape) for io in ts.program.inputs
                    if io.name.startswith("params.layers_")]
    outside = [(blocks[io.name].shape, io.shape) for io in ts.program.inputs
               if io.name.startswith(("params.", "opt_state.m.")) and "layers_" not in io.name]
    got, want_state = ts.named(got), ts.named(want[0])
    assert len(want_state) > 20
    for name in want_state:
        np.testing.assert_allclose(got[name], want_state[name], rtol=1e-9, atol=1e-12, err_msg=name)
    for rank_losses in all_losses:
        np.testing.assert_allclose(rank_losses, want[1], rtol=1e-12)
    assert want[1][2] < want[1][0]
    # this rank's stage: 1/S of every stacked layer parameter (its L/S layers), the megatron dims further split
    assert len(layer_blocks) == 10
    assert all(block[0] * shape[0] == whole[0] and np.prod(block) * shape[0] <= np.prod(whole)
               for block, whole in layer_blocks)
    assert len(outside) == 2 * (4 if tied else 5)
    assert all(np.prod(block) * shape[0] <= np.prod(whole) for block, whole in outside), outside


@pytest.mark.skipif(N < 2, reason="a pipeline needs 2 or more ranks")
@pytest.mark.parametrize("bad", ["no stage axis", "stages do not divide layers"])
def test_bad_pipeline_setups_raise_on_every_rank(bad):
    if bad == "no stage axis":
        mesh, cfg, message = train_mesh((N,), "dp"), PIPE_CFG, "which must be one axis of the mesh"
    else:
        mesh, cfg = train_mesh((N,), "pipeline"), LMConfig(**{**PIPE_CFG.__dict__, "layers": N + 1})
        message = f"needs the stage count to divide the layers; got {N} stages"
    with pytest.raises(ValueError, match=message):
        build_train_step_on_root(cfg, mesh, "pipeline", OPT, WORLD, 2)
