"""Values that must be the same on every rank, in the simulated world (issue 30): the digests of values a call
promises are global (device_put's array, jit's NumPy arguments, sr.run's inputs, TrainStep's batch), the
settings that change the program or its numerics, the programs themselves, and the dtypes refused at the door.
Each check fails when its value differs on one rank only, and raises no false alarm when the bytes are equal
(NaNs, -0.0, non-contiguous arrays)."""
import os
import threading

import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime.comm import agreement, run_simulated
from spmd_runtime.exec import runner

from simulated import errors_on_every_rank

MESH2, MESH4 = sr.Mesh((2,), ("x",)), sr.Mesh((4,), ("x",))
SKIP = "check_inputs=False (or SPMD_CHECK_INPUTS=0) skips this check"


def _same_error(n, fn) -> str:
    """The one error every rank raised (asserting each rank raised it, and alike)."""
    errors = errors_on_every_rank(n, fn)
    assert errors[0] is not None and errors == [errors[0]] * n, errors
    return errors[0]


def _awkward(rank: int):
    """The same values on every rank in different memory layouts: NaNs, -0.0, and a strided view on odd ranks."""
    x = np.array([[np.nan, -0.0, 1.5, -np.inf], [2.0, np.nan, -0.0, 3.0]] * 2)
    if rank % 2:
        wide = np.zeros((4, 8))
        wide[:, ::2] = x
        return wide[:, ::2]  # not contiguous
    return np.asfortranarray(x) if rank == 2 else x


# ---------------------------------------------------------------- the digest
@pytest.fixture(params=["xxh3_64", "crc32"])
def kind(request, monkeypatch):
    """Each digest: xxhash's (skipped where it is not installed) and the zlib fallback."""
    if request.param == "crc32":
        monkeypatch.setattr(agreement, "xxhash", None)
    elif agreement.xxhash is None:
        pytest.skip("xxhash is not installed (pip install spmd_runtime[digest])")
    monkeypatch.setattr(agreement, "DIGEST", request.param)
    return request.param


def test_equal_bytes_give_equal_digests_whatever_the_layout(kind):
    x = _awkward(0)
    assert len({agreement.digest(_awkward(r)) for r in range(4)}) == 1
    assert agreement.digest(np.float64(np.nan)) == agreement.digest(np.array(np.nan))
    assert agreement.digest(x) < (1 << 64 if kind == "xxh3_64" else 1 << 32)
    assert agreement.digests([x, None]) == (kind, agreement.digest(x), None)


def test_digests_differ_on_one_element_a_shape_or_a_dtype(kind):
    x = np.arange(12.0)
    changed = x.copy()
    changed[7] = np.nextafter(changed[7], 99)
    others = [changed, x.reshape(3, 4), x.view(np.int64), np.where(x == 0, -0.0, x), x[:0], x.reshape(12, 1)[:0]]
    assert len({agreement.digest(y) for y in [x, *others]}) == len(others) + 1


# ---------------------------------------------------------------- device_put
def test_device_put_of_an_array_differing_on_one_rank_fails_on_every_rank_naming_the_ranks():
    def call(comm):
        sr.device_put(np.arange(8.0) + (comm.Get_rank() == 2), sr.P("x"), MESH4, comm=comm)
    message = _same_error(4, call)
    assert message.startswith("DifferentValuesError: device_put needs the same global array on every rank; got "
                              "different contents for 'x': ranks [0, 1, 3] vs [2] (digests ")
    assert SKIP in message


def test_device_put_of_equal_bytes_passes_and_keeps_each_block():
    def call(comm):
        return np.asarray(sr.device_put(_awkward(comm.Get_rank()), sr.P("x"), MESH4, comm=comm))
    for got in run_simulated(4, call):
        np.testing.assert_array_equal(got, _awkward(0))


def test_the_check_skipped_on_every_rank_leaves_the_mix_it_exists_to_prevent(monkeypatch):
    put = lambda comm, **kw: np.asarray(sr.device_put(np.arange(4.0) * comm.Get_rank(), sr.P("x"), MESH2, comm=comm,
                                                      **kw))
    for got in run_simulated(2, lambda comm: put(comm, check_inputs=False)):
        np.testing.assert_array_equal(got, [0, 0, 2, 3])  # rank 0's first half, rank 1's second half
    monkeypatch.setenv("SPMD_CHECK_INPUTS", "0")  # read when each simulated rank's Runtime is made
    for got in run_simulated(2, put):
        np.testing.assert_array_equal(got, [0, 0, 2, 3])


def test_the_check_skipped_on_one_rank_only_fails_on_every_rank():
    message = _same_error(2, lambda comm: sr.device_put(np.ones(4), sr.P("x"), MESH2, comm=comm,
                                                        check_inputs=comm.Get_rank() == 0))
    assert "every rank must make the same choice of checking" in message
    assert "got the check on ranks [0] and none on ranks [1]" in message


def test_device_put_with_a_spec_differing_on_one_rank_fails_on_every_rank():
    message = _same_error(2, lambda comm: sr.device_put(np.ones(4), sr.P("x") if comm.Get_rank() else sr.P(), MESH2,
                                                        comm=comm))
    assert "device_put takes the same global array and layout on every rank" in message
    assert "{0: ((4,), 'float64', '[R]'), 1: ((4,), 'float64', '[x]')}" in message


# ---------------------------------------------------------------- jit, sr.run, TrainStep
def test_jit_numpy_argument_differing_on_one_rank_fails_naming_its_path():
    def call(comm):
        params = {"w": np.ones(4), "b": np.full(4, 2.0 + (comm.Get_rank() == 3))}
        sr.jit(lambda p, x: p["w"] * x + p["b"], mesh=MESH4, comm=comm)(params, np.arange(4.0))
    message = _same_error(4, call)
    assert message.startswith("DifferentValuesError: jit(<lambda>) needs the same value for each NumPy argument on "
                              "every rank")
    assert "got different contents for 'p.b': ranks [0, 1, 2] vs [3] (digests" in message
    assert "'p.w'" not in message and "'x'" not in message


def test_jit_of_equal_bytes_and_of_per_rank_darrays_passes():
    def call(comm):
        rank = comm.Get_rank()
        blocks = sr.from_local(np.full((1, 8), float(rank)), sr.P("x"), MESH4, comm=comm)  # differs: not promised
        return np.asarray(sr.jit(lambda a, b: a + b.sum(), mesh=MESH4, comm=comm)(_awkward(rank), blocks))
    for got in run_simulated(4, call):
        np.testing.assert_array_equal(got, _awkward(0) + 8.0 * 6)


def test_run_input_differing_on_one_rank_fails_naming_it():
    program = sr.partition(sr.trace(lambda a, b: a + b, sr.TensorSpec((4,), "float64"), sr.TensorSpec((4,), "float64")),
                           MESH2, in_specs=[("x",), None])
    message = _same_error(2, lambda comm: sr.run(program, np.ones(4), np.arange(4.0) * comm.Get_rank(), comm=comm))
    assert "every rank must pass the same global inputs to sr.run; got different contents for 'b': ranks [0] vs " \
           "[1]" in message and "'a'" not in message


@pytest.fixture(scope="module")
def train_step():
    cfg = sr.LMConfig(layers=1, d=8, heads=2, ffn=16, vocab=16, seq=4, batch=4)
    return sr.build_train_step(cfg, sr.train_mesh((2,), "dp"), "dp", sr.SGD(lr=0.1))


def test_train_batch_differing_on_one_rank_fails_instead_of_one_mixed_loss(train_step):
    state, tokens = train_step.init(0), np.arange(16).reshape(4, 4) % 16

    def step(comm, check=None):
        local = train_step.shard_state(state, comm.Get_rank())
        labels = (tokens + comm.Get_rank()) % 16  # rank 1's labels are others
        return train_step.step(local, tokens, labels, comm=comm, check_inputs=check)[1]
    message = _same_error(2, step)
    assert message.startswith("DifferentValuesError: TrainStep.step needs the same global batch on every rank")
    assert "got different contents for 'batch.labels': ranks [0] vs [1]" in message
    assert "batch.tokens" not in message
    mixed = run_simulated(2, lambda comm: step(comm, check=False))
    assert mixed[0] == mixed[1]  # unchecked: one loss of a batch no rank holds, reported on both


def test_train_batch_equal_on_every_rank_passes(train_step):
    state, tokens = train_step.init(0), np.arange(16).reshape(4, 4) % 16
    losses = run_simulated(2, lambda comm: train_step.step(train_step.shard_state(state, comm.Get_rank()), tokens,
                                                           tokens.astype(np.int32), comm=comm)[1])
    assert losses[0] == losses[1] == pytest.approx(train_step.reference_step(state, tokens, tokens)[1], rel=1e-5)


# ---------------------------------------------------------------- settings
class _RankEnviron(dict):
    """os.environ as each simulated rank (a thread) sees it: the real one plus this thread's ``overrides``."""

    def __init__(self, real):
        super().__init__(real)
        self.local = threading.local()

    def _mine(self) -> dict:
        return getattr(self.local, "overrides", {})

    def get(self, key, default=None):
        return self._mine().get(key, super().get(key, default))

    def __getitem__(self, key):
        return self._mine()[key] if key in self._mine() else super().__getitem__(key)

    def __contains__(self, key):
        return key in self._mine() or super().__contains__(key)


@pytest.fixture
def rank_environ(monkeypatch):
    environ = _RankEnviron(os.environ)
    monkeypatch.setattr(os, "environ", environ)
    return environ


def _program():
    return sr.partition(sr.trace(lambda a: (snp.exp(a) * 2.0).sum(), sr.TensorSpec((8,), "float64")), MESH2,
                        in_specs=[("x",)])


@pytest.mark.parametrize("name, value", [("SPMD_CPU_KERNELS", "0"), ("SPMD_CPU_KERNEL_MIN", "1"),
                                         ("SPMD_CPU_GROUPS", "0"), ("SPMD_FUSE", "0"), ("SPMD_FUSE_DUPLICATE", "0"),
                                         ("SPMD_ASYNC", "0"), ("SPMD_ASYNC_BUDGET", "1024"),
                                         ("SPMD_SCAN_PREFETCH", "1"), ("SPMD_WINDOWED_EINSUM", "0"),
                                         ("SPMD_PLAN_BUFFERS", "0"), ("SPMD_CHECK_INPUTS", "0")])
def test_a_setting_differing_on_one_rank_fails_every_run_naming_it(rank_environ, name, value):
    program = _program()

    def call(comm):
        rank_environ.local.overrides = {name: value} if comm.Get_rank() == 1 else {}
        sr.run(program, np.arange(8.0), comm=comm)
    message = _same_error(2, call)
    assert "AgreedError: every rank must run with the same settings" in message
    assert f"got different {name} (" in message and "ranks [0]: " in message and "ranks [1]: " in message
    assert message.count("SPMD_") == 1, message  # only the one that differs


def test_a_cost_profile_differing_on_one_rank_fails_naming_it(rank_environ, tmp_path):
    profile = tmp_path / "profile.json"
    profile.write_text('{"format": "spmd_runtime.cost_profile", "fits": [{"op": "all_reduce", "k": 2, "alpha": 1e-5, '
                       '"beta": 1e-9}]}')
    program = _program()

    def call(comm):
        rank_environ.local.overrides = {"SPMD_COST_PROFILE": str(profile)} if comm.Get_rank() else {}
        sr.run(program, np.arange(8.0), comm=comm)
    message = _same_error(2, call)
    assert "got different SPMD_COST_PROFILE (the partitioner's choices): ranks [0]: 'ring #" in message
    assert "ranks [1]: 'profile:profile.json #" in message


def test_settings_equal_on_every_rank_pass_and_are_read_once_per_runtime(rank_environ, monkeypatch):
    reads = []
    monkeypatch.setattr(runner, "read_settings", lambda real=runner.read_settings: reads.append(1) or real())
    program = _program()

    def call(comm):
        rank_environ.local.overrides = {"SPMD_CPU_KERNELS": "0", "SPMD_FUSE": "0"}  # on every rank
        with sr.Runtime(comm) as rt:
            outs = [sr.run(program, np.arange(8.0), comm=rt)[0] for _ in range(3)]
            rt.unbind()  # the settings are read anew
            return outs + [sr.run(program, np.arange(8.0), comm=rt)[0]]
    for outs in run_simulated(2, call):
        assert outs == [outs[0]] * 4 and outs[0] == pytest.approx(2 * np.exp(np.arange(8.0)).sum())
    assert len(reads) == 2 * 2  # per rank: when its runtime was made, and when it unbound


def test_jit_building_different_programs_under_different_settings_names_the_setting(rank_environ):
    def call(comm):
        rank_environ.local.overrides = {"SPMD_FUSE": "0"} if comm.Get_rank() == 0 else {}
        sr.jit(lambda a: (a * 2.0 + 1.0).sum(), mesh=MESH2, comm=comm)(np.ones(8))
    message = _same_error(2, call)
    assert "jit(<lambda>) must build the same program on every rank; every rank must run with the same settings" \
           in message
    assert "got different SPMD_FUSE (the program's fusions): ranks [0]: False; ranks [1]: True" in message


# ---------------------------------------------------------------- programs
def test_jit_of_rank_dependent_code_says_where_the_programs_differ():
    def call(comm):
        sr.jit(lambda a: snp.exp(a) if comm.Get_rank() == 1 else snp.tanh(a), mesh=MESH2, comm=comm)(np.ones(4))
    message = _same_error(2, call)
    assert "the same arguments and settings, but the function traced to programs that first differ at line 2" \
           in message
    assert ("ranks [0]: '%1 = tanh(%0) : float64[4] [R]  # test_agreement.py:259'; ranks [1]: '%1 = exp(%0) : "
            "float64[4] [R]  # test_agreement.py:259'") in message  # the listing names the user's line too


def test_run_of_different_programs_says_where_they_differ():
    programs = [sr.partition(sr.trace(f, sr.TensorSpec((4,), "float64")), MESH2, in_specs=[("x",)], fuse=False)
                for f in (lambda a: a.sum(), lambda a: (a * 3.0).sum())]
    message = _same_error(2, lambda comm: sr.run(programs[comm.Get_rank()], np.ones(4), comm=comm))
    assert "every rank must run the same program; got programs that first differ at line 2" in message
    assert "ranks [0]: '%1 = reduce(%0" in message and "ranks [1]: '%1 = constant(" in message


# ---------------------------------------------------------------- from_local and dtypes at the door
def test_from_local_with_a_different_ndim_on_one_rank_fails_on_every_rank():
    message = _same_error(2, lambda comm: sr.from_local(np.ones((2, 2)) if comm.Get_rank() else np.ones(2),
                                                        sr.P("x"), MESH2, comm=comm))
    assert "from_local blocks share one number of dimensions; got shapes {0: [2], 1: [2, 2]} by rank" in message


def test_from_local_with_a_spec_or_shape_differing_on_one_rank_fails_on_every_rank():
    message = _same_error(2, lambda comm: sr.from_local(np.ones((2, 2)), sr.P("x") if comm.Get_rank() else
                                                        sr.P(None, "x"), MESH2, comm=comm))
    assert "from_local takes the same spec and shape on every rank" in message
    message = _same_error(2, lambda comm: sr.from_local(np.ones((2, 2)), sr.P("x"), MESH2, comm=comm,
                                                        shape=(4, 2) if comm.Get_rank() else (3, 2)))
    assert "from_local takes the same spec and shape on every rank" in message and "(3, 2)" in message


OBJECTS = np.array([1.0, "a", None, 2.0], dtype=object)


@pytest.mark.parametrize("where, call, name", [
    ("device_put", lambda comm, x: sr.device_put(x, sr.P("x"), MESH2, comm=comm), "for x"),
    ("from_local", lambda comm, x: sr.from_local(x[:2], sr.P("x"), MESH2, comm=comm), "for this rank's block"),
    ("jit", lambda comm, x: sr.jit(lambda a: a, mesh=MESH2, comm=comm)({"w": x}), "for args.0.w"),
    ("run", lambda comm, x: sr.run(sr.partition(sr.trace(lambda a: a * 2.0, sr.TensorSpec((4,), "float64")), MESH2),
                                   x, comm=comm), "for 'a'"),
])
def test_object_arrays_are_refused_at_the_door_on_every_rank(where, call, name):
    message = _same_error(2, lambda comm: call(comm, OBJECTS if comm.Get_rank() else np.ones(4)))
    assert "errors on rank(s) [1]" in message and "takes arrays of numbers or booleans; got dtype object " + name \
        in message and "pointers to Python objects" in message, message


def test_string_arrays_are_refused_by_jit_naming_the_argument():
    message = _same_error(2, lambda comm: sr.jit(lambda a: a, mesh=MESH2, comm=comm)(np.array(["ab", "cd"])))
    assert "jit(<lambda>) takes arrays of numbers or booleans; got dtype <U2 for args.0" in message


def test_a_jit_argument_of_an_unparsable_dtype_on_one_rank_fails_on_every_rank():
    """Describing the arguments for the agreement once raised on that rank alone: the others waited for it."""
    class Odd:
        shape, dtype = (4,), "no-such-dtype"
    message = _same_error(2, lambda comm: sr.jit(lambda a: a * 2.0, mesh=MESH2, comm=comm)(
        Odd() if comm.Get_rank() else np.ones(4)))
    assert "errors on rank(s) [1]: rank 1: TypeError: data type 'no-such-dtype' not understood" in message


def test_ranks_making_digests_of_different_kinds_are_told_to_install_xxhash_alike():
    gathered = [("xxh3_64", 1), ("crc32", 1)]
    with pytest.raises(agreement.DifferentValuesError, match=r"digests of different kinds \(xxh3_64: ranks \[0\]; "
                                                             r"crc32: ranks \[1\]\): install xxhash on every rank"):
        agreement.check_same(gathered, ["x"], "rule", "")
    agreement.check_same([("crc32", 5, None), ("crc32", 5, None)], ["x", "y"], "rule", "")  # equal: no error
