"""Differential fuzzing in the in-process simulated world: random programs over the op set, random
shardings, random 1-d/2-d meshes of 1 to 8 devices (3 and 6 included), uneven sizes; the partitioned
result must equal the reference evaluator on every case. Derandomized, so CI runs the same cases."""
import warnings

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import spmd_runtime as sr
from spmd_runtime.comm import run_simulated

from fuzz_programs import check_case, random_case

FUZZ_CASES = 1000


def simulated(program, inputs):
    outs = run_simulated(program.mesh.size, lambda comm: sr.run(program, *inputs, comm=comm))
    assert all(len(o) == len(outs[0]) for o in outs)
    return outs[0]


@settings(max_examples=FUZZ_CASES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.integers(min_value=0, max_value=2**31 - 1))
def test_random_programs_match_reference(seed):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rematerialisation notes are expected on random shardings
        check_case(random_case(seed), simulated)
