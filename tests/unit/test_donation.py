"""Donated inputs (``partition(donate=...)``, ``jit(donate_argnums=...)``, ``build_train_step(donate=True)``):
the program writes its results into the buffers of inputs that die, the caller's arrays are only ever
overwritten where the caller handed them over (``run_local``, DArrays), and the results are the same bits."""
import warnings

import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime.comm import run_simulated
from spmd_runtime.exec.groups import sibling_groups
from spmd_runtime.models.lm import LMConfig
from spmd_runtime.train import build_train_step, train_mesh

MESH = sr.Mesh((2,), ("x",))


def sgd(p, g, v):
    """A momentum update: the new velocity feeds the new parameter (one sibling group when fused)."""
    v2 = 0.9 * v + g
    return p - 0.1 * v2, v2


def sgd_program(donate=(), **kw):
    specs = [sr.TensorSpec((8, 3), "float64")] * 3
    return sr.partition(sr.trace(sgd, *specs), MESH, in_specs=[("x", None)] * 3, donate=donate, **kw)


def inputs(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((8, 3)) for _ in range(3)]


@pytest.mark.parametrize("fuse", [True, False])
def test_updates_write_into_the_donated_inputs_they_replace(fuse):
    program = sgd_program(donate=("p", 2), fuse=fuse)  # by name and by position
    assert program.donated == {0, 2}
    assert "%0 p: float64[8,3] [x, R] donated" in str(program) and "%1 g: float64[8,3] [x, R]," in str(program)
    params = {i.out: i.attrs["index"] for i in program.instrs if i.op == "parameter"}
    written = sorted(params[i.args[i.donate]] for i in program.instrs if i.donate >= 0 and i.args[i.donate] in params)
    assert written == [0, 2]  # p' into p, v' into v; g (not donated) is never written
    assert sgd_program().donated == frozenset()


@pytest.mark.parametrize("bad", [5, -1, "w", 1.0, True])
def test_a_bad_donation_names_the_rule_and_the_inputs(bad):
    with pytest.raises(ValueError, match=r"donate takes input positions in \[0, 3\) or input names \['g', 'p', 'v'\]"):
        sgd_program(donate=[bad])


def test_run_local_overwrites_the_donated_arrays_and_computes_the_same():
    program, xs = sgd_program(donate=(0, 2)), inputs()
    want = sr.evaluate(sr.trace(sgd, *xs), *xs)

    def body(comm):
        rank = comm.Get_rank()
        local = [np.ascontiguousarray(x[4 * rank:4 * rank + 4]) for x in xs]
        g_before = local[1].copy()
        outs = sr.run_local(program, *local, comm=comm)
        return [np.shares_memory(o, local[k]) for o, k in zip(outs, (0, 2))], np.array_equal(local[1], g_before), \
            [o.copy() for o in outs]

    for rank, (shared, g_kept, outs) in enumerate(run_simulated(2, body)):
        assert shared == [True, True], "the new p and v must live in the donated p and v"
        assert g_kept, "a non-donated input must never be written"
        for got, w in zip(outs, want):
            np.testing.assert_array_equal(got, w[4 * rank:4 * rank + 4])


def test_aliased_or_strided_donated_inputs_are_copied_with_a_warning():
    program, xs = sgd_program(donate=(0,)), inputs(1)

    def body(comm):
        rank = comm.Get_rank()
        p = np.ascontiguousarray(xs[0][4 * rank:4 * rank + 4])
        aliased = sr.run_local(program, p, p, p, comm=comm)[0].copy()  # p also passed as g and v
        fortran = sr.run_local(program, np.asfortranarray(p), p.copy(), p.copy(), comm=comm)[0].copy()
        return aliased, fortran

    x = np.ascontiguousarray(xs[0])
    with warnings.catch_warnings(record=True) as caught:  # process-wide: the simulated ranks are threads
        warnings.simplefilter("always")
        results = run_simulated(2, body)
    messages = [str(w.message) for w in caught]
    for rank, (aliased, fortran) in enumerate(results):
        mine = x[4 * rank:4 * rank + 4]
        want = sr.evaluate(sr.trace(sgd, *[sr.TensorSpec((4, 3), "float64")] * 3), mine, mine, mine)[0]
        np.testing.assert_array_equal(aliased, want)
        np.testing.assert_array_equal(fortran, want)
        assert any("donated input 'p' was copied before the run: it shares memory with another input" in m
                   for m in messages), messages
        assert any("it is not a writeable C-ordered array" in m for m in messages), messages


def test_run_and_jit_never_write_into_the_callers_global_arrays():
    program, xs = sgd_program(donate=(0, 1, 2)), inputs(2)
    kept = [x.copy() for x in xs]
    f = sr.jit(sgd, mesh=MESH, in_specs=(sr.P("x"),) * 3, donate_argnums=(0, 2))

    def body(comm):
        ran = sr.run(program, *xs, comm=comm)
        jitted = sr.jit(sgd, mesh=MESH, in_specs=(sr.P("x"),) * 3, donate_argnums=(0, 2), comm=comm)(*xs)
        return ran, [np.asarray(o) for o in jitted]

    want = sr.evaluate(sr.trace(sgd, *xs), *xs)
    for ran, jitted in run_simulated(2, body):
        for got in (ran, jitted):
            for g, w in zip(got, want):
                np.testing.assert_array_equal(g, w)
    for x, k in zip(xs, kept):
        np.testing.assert_array_equal(x, k)
    assert f.lower(*xs).donated == {0, 2}


def test_jit_rejects_static_or_missing_donate_argnums():
    f = sr.jit(lambda x, k: x * k, mesh=MESH, static_argnums=1, donate_argnums=(1,))
    with pytest.raises(ValueError, match=r"donate_argnums must index the 2 arguments, none of them static \(\[1\]\); "
                                         r"got \[1\]"):
        f.lower(np.ones(4), 2.0)


def test_jit_consumes_a_donated_darray():
    def body(comm):
        x = sr.device_put(np.arange(8.0), sr.P("x"), MESH, comm=comm)
        local = x.local
        f = sr.jit(lambda a: a * 2.0, mesh=MESH, comm=comm, donate_argnums=0)
        y = f(x)
        with pytest.raises(RuntimeError, match=r"this DArray was donated to jit\(<lambda>\) \(donate_argnums\): its "
                                               r"buffer now holds that call's result; use the result instead"):
            np.asarray(x)
        return np.shares_memory(y.local, local), np.asarray(y), x.is_deleted(), repr(x)

    for shared, y, deleted, text in run_simulated(2, body):
        assert shared, "the result must be written into the donated DArray's block"
        np.testing.assert_array_equal(y, np.arange(8.0) * 2.0)
        assert deleted and text.endswith("donated to jit(<lambda>) (donate_argnums))")


CFG = LMConfig(layers=2, d=16, heads=4, ffn=32, vocab=24, seq=8, batch=8)


@pytest.mark.parametrize("preset", ["dp", "fsdp"])
def test_a_donating_train_step_gives_the_bits_of_the_plain_one(preset):
    """The state updated in place (AdamW writes p', m', v' into p, m, v, still one loop per parameter): the
    same losses and state, bit for bit, over three steps; the state passed to ``shard_state`` is untouched."""
    mesh = train_mesh((2,), preset)
    plain, donating = build_train_step(CFG, mesh, preset), build_train_step(CFG, mesh, preset, donate=True)
    assert len(donating.program.donated) == len(donating.state_names)
    assert len(sibling_groups(donating.program)) == len(sibling_groups(plain.program)) > 0
    params = {i.out for i in donating.program.instrs if i.op == "parameter"}
    assert sum(i.donate >= 0 and i.args[i.donate] in params for i in donating.program.instrs) >= 3 * 10
    _same_training(plain, donating, steps=3)


def test_a_saved_program_keeps_its_donations(tmp_path):
    from spmd_runtime.program import load_program
    program = sgd_program(donate=(0, 2))
    program.save(tmp_path / "p.json")
    loaded = load_program(tmp_path / "p.json")
    assert loaded.donated == {0, 2} and loaded.hash == program.hash != sgd_program().hash


# ---------------------------------------------------------------- loop carries updated in place
def _scanning(body, summed=False):
    """``f(a, b, xs)``: ``body`` scanned over xs [5, 8, 3] from carries (a, b) [8, 3]; ``summed``: the final
    carries die inside, only their sums leave (then the loop may keep its carry buffers from run to run)."""
    def f(a, b, xs):
        (c, d), ys = sr.scan(body, (a, b), xs)
        return ((snp.sum(c), snp.sum(d)) if summed else (c, d)), ys
    return f


def _scan_of(body, summed=False):
    """The partitioned ``_scanning`` program and its scan's body."""
    specs = [sr.TensorSpec((8, 3), "float64")] * 2 + [sr.TensorSpec((5, 8, 3), "float64")]
    program = sr.partition(sr.trace(_scanning(body, summed), *specs), MESH,
                           in_specs=[("x", None)] * 2 + [(None, "x", None)])
    return program, next(i for i in program.instrs if i.op == "scan").attrs["body"]


def _also_a_y(s, t):
    return (s, t), s


# (name, body, carries the body makes alone: donated, and those written in place)
CARRY_CASES = [
    ("accumulate", lambda c, x: ((c[0] + x, c[1] * x), snp.sum(x)), {0, 1}, {0, 1}),
    ("handed_on", lambda c, x: ((c[0], c[1] + x), snp.sum(x)), {1}, {1}),  # c0 is the operand itself
    ("swapped", lambda c, x: ((c[1], c[0]), snp.sum(x)), set(), set()),
    ("from_xs", lambda c, x: ((x, c[1] + x), snp.sum(x)), {1}, {1}),  # c0 views an xs slice
    ("shared", lambda c, x: (((c[0] + x),) * 2, snp.sum(x)), set(), set()),  # one buffer for both carries
    ("also_a_y", lambda c, x: _also_a_y(c[0] + x, c[1] + x), {1}, {1}),  # c0' is also stacked into ys
]


@pytest.mark.parametrize("summed", [False, True], ids=["carries_out", "carries_die"])
@pytest.mark.parametrize("name,body,donated,written", CARRY_CASES, ids=[c[0] for c in CARRY_CASES])
def test_a_scan_body_writes_the_carries_it_owns_in_place(name, body, donated, written, summed):
    """A carry whose body result is a buffer the body alone makes is donated to the body (each iteration
    writes into the last one's buffer); a carry that may be an operand, an xs slice, or share its buffer
    with another result is not. Over two runs on different inputs: the caller's initial carries are never
    written, the first run's results are not overwritten by the second, and both are the reference's."""
    program, scanned = _scan_of(body, summed)
    assert scanned.donated == donated and scanned.written_inputs == written
    rng = np.random.default_rng(2)
    runs = [[rng.standard_normal((8, 3)), rng.standard_normal((8, 3)), rng.standard_normal((5, 8, 3))]
            for _ in range(2)]
    f = _scanning(body, summed)
    wants = [sr.pytree.flatten(sr.evaluate(sr.trace(f, *xs), *xs))[0] for xs in runs]

    def run(comm):
        r = comm.Get_rank()
        local = [[np.ascontiguousarray(x[..., 4 * r:4 * r + 4, :]) for x in xs] for xs in runs]
        kept = [[x.copy() for x in xs] for xs in local]
        outs = [sr.run_local(program, *xs, comm=comm) for xs in local]  # the first run's results held, uncopied
        return outs, all(np.array_equal(x, k) for xs, ks in zip(local, kept) for x, k in zip(xs, ks))

    for r, (outs, untouched) in enumerate(run_simulated(2, run)):
        assert untouched, "a scan must write its carries into buffers of its own, never the caller's"
        for got, want in zip(outs, wants):
            for g, w in zip(got, want):
                part = w if w.shape == g.shape else w[..., 4 * r:4 * r + 4, :]  # a split carry or ys
                np.testing.assert_allclose(g, part, rtol=1e-12)


@pytest.mark.parametrize("scan_layers,microbatches", [(True, 1), (False, 2), (True, 2)])
def test_scanned_and_accumulating_steps_update_every_state_buffer_in_place(scan_layers, microbatches):
    """With layers scanned or gradients accumulated over micro-batches, the donating step still writes every
    new parameter and moment into its donated input (a scan's stacked results and owned carries are its own
    buffers, not views of its operands), and gives the plain step's bits."""
    cfg = LMConfig(**{**CFG.__dict__, "scan_layers": scan_layers})
    mesh = train_mesh((2,), "dp")
    plain = build_train_step(cfg, mesh, "dp", microbatches=microbatches)
    donating = build_train_step(cfg, mesh, "dp", microbatches=microbatches, donate=True)
    prog = donating.program
    donated_params = {i.out for i in prog.instrs if i.op == "parameter" and i.attrs.get("donated")}

    def home(slot):  # the buffer a result is written into: followed through in-place writes
        ins = prog.instrs[slot]
        return home(ins.args[ins.donate]) if ins.donate >= 0 else slot
    n = len(donating.state_names)  # the new state comes first, as the inputs' state
    assert [(o.shape, o.dtype) for o in prog.outputs[:n]] == [(i.shape, i.dtype) for i in prog.inputs[:n]]
    state_outputs = [o.slot for o in prog.outputs[:n]]
    assert sum(home(s) in donated_params for s in state_outputs) >= len(state_outputs) - 1  # all but AdamW's count
    _same_training(plain, donating)


def _same_training(plain, donating, steps=2):
    """The same losses and state, bit for bit, over ``steps`` steps on 2 simulated ranks; the state passed to
    ``shard_state`` is untouched."""
    state = plain.init(1)
    kept = [x.copy() for x in sr.pytree.flatten(state)[0]]
    rng = np.random.default_rng(0)
    data = [(rng.integers(0, 24, (8, 8)), rng.integers(0, 24, (8, 8))) for _ in range(steps)]

    def train(ts):
        def body(comm):
            local, losses = ts.shard_state(state, comm.Get_rank()), []
            for x, y in data:
                local, loss = ts.step(local, x, y, comm=comm)
                losses.append(loss)
            return sr.pytree.flatten(ts.gather(local, comm))[0], losses
        return run_simulated(2, body)

    for (want, want_losses), (got, losses) in zip(train(plain), train(donating)):
        assert losses == want_losses
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
    for x, k in zip(sr.pytree.flatten(state)[0], kept):
        np.testing.assert_array_equal(x, k)


@pytest.mark.parametrize("trips", [0, 3])
def test_a_while_body_writes_its_accumulator_in_place(trips):
    """``while i < n: (i, acc) = (i + 1, acc * 0.5 + w)``: both carries are the body's own, so it writes them in
    place, into the loop's copy of the initial values (the caller's stay as they were), also when the loop
    runs no iteration."""
    def f(i, acc, w):
        return sr.while_loop(lambda c: c[0] < trips, lambda c: (c[0] + 1, c[1] * 0.5 + w), (i, acc))
    specs = [sr.TensorSpec((), "int32"), sr.TensorSpec((8, 3), "float64"), sr.TensorSpec((8, 3), "float64")]
    program = sr.partition(sr.trace(f, *specs), MESH, in_specs=[(), ("x", None), ("x", None)])
    body = next(i for i in program.instrs if i.op == "while").attrs["body"]
    assert body.donated == {0, 1} and 1 in body.written_inputs
    rng = np.random.default_rng(3)
    acc, w = rng.standard_normal((8, 3)), rng.standard_normal((8, 3))
    want = sr.evaluate(sr.trace(f, *specs), np.int32(0), acc, w)[1]

    def run(comm):
        r = comm.Get_rank()
        local = [np.int32(0), np.ascontiguousarray(acc[4 * r:4 * r + 4]), np.ascontiguousarray(w[4 * r:4 * r + 4])]
        kept = local[1].copy()
        got = sr.run_local(program, *local, comm=comm)[1].copy()
        return got, np.array_equal(local[1], kept)

    for r, (got, untouched) in enumerate(run_simulated(2, run)):
        assert untouched
        np.testing.assert_allclose(got, want[4 * r:4 * r + 4], rtol=1e-12)


def test_a_loops_own_carry_is_no_view_of_its_operands():
    """``acc = while(..., p)`` then ``q = p * 3`` with p donated: the loop's final accumulator (alive after q)
    is its own copy, not a view of p, so q may still be written into p; the same through a scan."""
    def by_while(p, w):
        acc = sr.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1] * 0.5 + w), (snp.astype(snp.sum(w) * 0.0,
                                                                                          "int32"), p))[1]
        return p * 3.0, acc

    def by_scan(p, w):
        acc = sr.scan(lambda c, x: (c * 0.5 + x, snp.sum(x)), p, snp.stack([w, w]))[0]
        return p * 3.0, acc

    specs = [sr.TensorSpec((8, 3), "float64")] * 2
    rng = np.random.default_rng(4)
    p, w = rng.standard_normal((8, 3)), rng.standard_normal((8, 3))
    for f in (by_while, by_scan):
        program = sr.partition(sr.trace(f, *specs), MESH, in_specs=[("x", None)] * 2, donate=(0,))
        assert program.written_inputs == {0}, f.__name__
        want = sr.evaluate(sr.trace(f, *specs), p, w)

        def run(comm, program=program):
            r = comm.Get_rank()
            return [o.copy() for o in sr.run_local(program, np.ascontiguousarray(p[4 * r:4 * r + 4]),
                                                   np.ascontiguousarray(w[4 * r:4 * r + 4]), comm=comm)]
        for r, outs in enumerate(run_simulated(2, run)):
            for g, x in zip(outs, want):
                np.testing.assert_allclose(g, x[4 * r:4 * r + 4], rtol=1e-12)
