"""models/resnet.py's training step (``resnet.train_step``) under real MPI, for any world size (the suite runs it at
2 and 4 ranks): AdamW steps under dp and fsdp on the 1-d mesh of the world and megatron on an (N/2, 2) one, on a
batch of 5 images the data ranks split unevenly (3, 2 on 2; 2, 2, 1, 0 on 4: a rank with none); the losses,
updated parameters and batch-norm running statistics (cross-replica: the whole batch's) equal the step each rank
runs alone on the whole batch, to float32 rounding.

Run: ``mpiexec -n 4 python -m pytest --with-mpi tests/mpi/test_model_resnet_mpi.py -p no:cacheprovider``.
Assertions come after every collective, so one failing rank cannot hang the rest.
"""
from __future__ import annotations

import pytest
from mpi4py import MPI

import resnet_cases

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
N = WORLD.Get_size()
CASES = [("dp", (N,)), ("fsdp", (N,))] + ([("megatron", (N // 2, 2))] if N % 2 == 0 else [])


@pytest.fixture(scope="module")
def alone():
    """The 1-rank step: each rank on its own."""
    one = WORLD.Split(WORLD.Get_rank(), 0)
    try:
        return resnet_cases.steps("dp", (1,), comm=one)
    finally:
        one.Free()


@pytest.mark.parametrize("preset,shape", CASES, ids=str)
def test_train_step_on_the_world_equals_one_rank(alone, preset, shape):
    got = resnet_cases.steps(preset, shape, comm=WORLD)
    resnet_cases.assert_same_step(got, alone, f"{preset} on {shape}, rank {WORLD.Get_rank()}")
