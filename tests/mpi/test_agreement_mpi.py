"""Values that must be the same on every rank, under real MPI (issue 30): one rank's different global array, jit
argument, training batch, setting or traced code fails with the same error on EVERY rank, naming the value and
the ranks; equal bytes (NaNs, -0.0, strided views) pass.

Run: ``mpiexec -n N python -m pytest --with-mpi tests/mpi/test_agreement_mpi.py -p no:cacheprovider`` (N >= 2;
at N = 1 nothing can differ between ranks and the mismatch cases skip). Every rank's message is gathered and
compared after the collectives, so one failing rank cannot hang the rest.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
from mpi4py import MPI

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime.exec.runner import Runtime
from spmd_runtime.models.lm import LMConfig
from spmd_runtime.optim import SGD
from spmd_runtime.train import build_train_step_on_root, train_mesh

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
N, RANK, LAST = WORLD.Get_size(), WORLD.Get_rank(), WORLD.Get_size() - 1
MESH = sr.Mesh((N,), ("x",))
several = pytest.mark.skipif(N < 2, reason="values can differ between ranks only with 2 ranks or more")


def every_rank_error(fn) -> str:
    """The error ``fn()`` raised, the same on every rank (asserted after gathering every rank's)."""
    try:
        fn()
        mine = None
    except Exception as e:  # noqa: BLE001 - compared below
        mine = f"{type(e).__name__}: {e}"
    every = WORLD.allgather(mine)
    assert every[0] is not None and every == [every[0]] * N, every
    return every[0]


def awkward() -> np.ndarray:
    """The same values on every rank in a different layout on odd ranks (strided): NaNs, -0.0, infinities."""
    x = np.tile([np.nan, -0.0, 1.5, -np.inf, 2.0, np.nan, 0.0, 3.0], (N, 1))
    if RANK % 2:
        wide = np.zeros((N, 16))
        wide[:, ::2] = x
        return wide[:, ::2]
    return x


@several
def test_device_put_of_an_array_differing_on_the_last_rank_fails_on_every_rank():
    message = every_rank_error(lambda: sr.device_put(np.arange(4.0 * N) + (RANK == LAST), sr.P("x"), MESH))
    assert message.startswith("DifferentValuesError: device_put needs the same global array on every rank; got "
                              f"different contents for 'x': ranks {list(range(LAST))} vs [{LAST}] (digests ")


def test_device_put_and_jit_of_equal_bytes_pass():
    d = sr.device_put(awkward(), sr.P("x"), MESH)
    out = sr.jit(lambda a, b: a * 1.0 + b, mesh=MESH)(d, awkward())
    np.testing.assert_array_equal(np.asarray(out), awkward() * 2.0)


@several
def test_jit_numpy_argument_differing_on_one_rank_names_its_path():
    params = {"w": np.ones(N), "b": np.arange(N) + 1.0 * (RANK == 1)}
    message = every_rank_error(lambda: sr.jit(lambda p: p["w"] * p["b"], mesh=MESH)(params))
    assert "jit(<lambda>) needs the same value for each NumPy argument on every rank" in message
    assert f"got different contents for 'p.b': ranks {[r for r in range(N) if r != 1]} vs [1]" in message


@several
def test_train_batch_differing_on_one_rank_fails_instead_of_one_mixed_loss():
    cfg = LMConfig(layers=1, d=8, heads=2, ffn=16, vocab=16, seq=4, batch=2 * N)
    ts = build_train_step_on_root(cfg, train_mesh((N,), "dp"), "dp", SGD(lr=0.1), WORLD)
    local = ts.shard_state(ts.init(0), RANK)
    tokens = np.arange(cfg.batch * cfg.seq).reshape(cfg.batch, cfg.seq) % cfg.vocab
    _, loss = ts.step(local, tokens, tokens, comm=WORLD)  # equal: passes
    assert WORLD.allgather(loss) == [loss] * N
    labels = np.where(RANK == LAST, (tokens + 1) % cfg.vocab, tokens)
    message = every_rank_error(lambda: ts.step(local, tokens, labels, comm=WORLD))
    assert message.startswith("DifferentValuesError: TrainStep.step needs the same global batch on every rank")
    assert f"got different contents for 'batch.labels': ranks {list(range(LAST))} vs [{LAST}]" in message


@several
@pytest.mark.parametrize("name, value", [("SPMD_CPU_KERNELS", "0"), ("SPMD_FUSE", "0"), ("SPMD_ASYNC", "0")])
def test_a_setting_differing_on_one_rank_fails_every_run_naming_it(name, value):
    program = sr.partition(sr.trace(lambda a: (snp.exp(a) * 2.0).sum(), sr.TensorSpec((4 * N,), "float64")), MESH,
                           in_specs=[("x",)])
    before = os.environ.get(name)
    if RANK == 1:
        os.environ[name] = value
    Runtime.of(WORLD).unbind()  # the settings are read anew
    try:
        message = every_rank_error(lambda: sr.run(program, np.arange(4.0 * N), comm=WORLD))
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
        Runtime.of(WORLD).unbind()
    assert "AgreedError: every rank must run with the same settings" in message
    assert f"got different {name} (" in message and "ranks [1]: False" in message
    sr.run(program, np.arange(4.0 * N), comm=WORLD)  # agreed again


@several
def test_jit_of_rank_dependent_code_says_where_the_programs_differ():
    fn = (lambda a: snp.exp(a)) if RANK == LAST else (lambda a: snp.tanh(a))
    message = every_rank_error(lambda: sr.jit(fn, mesh=MESH)(np.ones(N)))
    assert "must build the same program on every rank; the same arguments and settings, but the function traced " \
           "to programs that first differ at line 2" in message
    assert f"ranks {list(range(LAST))}: '%1 = tanh(%0)" in message and f"ranks [{LAST}]: '%1 = exp(%0)" in message


@several
def test_from_local_with_a_different_ndim_on_one_rank_fails_on_every_rank():
    message = every_rank_error(lambda: sr.from_local(np.ones((1, 2)) if RANK == LAST else np.ones(1), sr.P("x"),
                                                     MESH))
    assert "from_local blocks share one number of dimensions" in message


def test_an_object_array_is_refused_on_every_rank():
    x = np.array([None] * N, dtype=object) if RANK == LAST else np.ones(N)
    message = every_rank_error(lambda: sr.device_put(x, sr.P("x"), MESH))
    assert f"errors on rank(s) [{LAST}]: rank {LAST}: device_put takes arrays of numbers or booleans; got dtype " \
           "object for x" in message
