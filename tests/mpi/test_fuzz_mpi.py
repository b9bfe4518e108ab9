"""Differential fuzzing under real MPI: the same seeds on every rank give the same random program on a
mesh of exactly this world size; partitioned result == reference evaluator."""
import warnings

import pytest
from mpi4py import MPI

import spmd_runtime as sr

from fuzz_programs import check_case, random_case

WORLD = MPI.COMM_WORLD.Get_size()
SEEDS = range(150 if WORLD > 1 else 20)


@pytest.mark.mpi
@pytest.mark.parametrize("seed", SEEDS)
def test_random_program_matches_reference(seed):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        case = random_case(seed, devices=WORLD)
        check_case(case, lambda program, inputs: sr.run(program, *inputs))


@pytest.mark.mpi
@pytest.mark.parametrize("seed", SEEDS[:50])
def test_random_program_with_donated_inputs_matches_reference(seed):
    """The same cases with every input donated: in-place writes into the inputs' copies, same results."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        case = random_case(seed, devices=WORLD)
        check_case(case, lambda program, inputs: sr.run(program, *inputs), donate=range(len(case.inputs)))


@pytest.mark.mpi
@pytest.mark.parametrize("seed", SEEDS[:30])
def test_random_program_ending_in_loops_matches_reference(seed):
    """Cases ending in scans and while loops (tests/fuzz_programs.py), every other one with donated inputs."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        case = random_case(seed, devices=WORLD, loops=True)
        check_case(case, lambda program, inputs: sr.run(program, *inputs),
                   donate=range(len(case.inputs)) if seed % 2 else ())
