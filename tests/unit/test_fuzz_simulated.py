"""Differential fuzzing in the in-process simulated world: random programs over the op set, random
shardings, random 1-d/2-d meshes of 1 to 8 devices (3 and 6 included), uneven sizes; the partitioned
result must equal the reference evaluator on every case. Derandomized, so CI runs the same cases."""
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime.comm import run_simulated
from spmd_runtime.cost import CostModel

from fuzz_programs import FuzzCase, check_case, random_case, random_mesh, random_sharding

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


DONATED_CASES = 300


@settings(max_examples=DONATED_CASES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.integers(min_value=0, max_value=2**31 - 1))
def test_random_programs_with_every_input_donated_match_reference(seed):
    """Every input donated (``partition(donate=...)``): ops write into the inputs where they die, and the
    results still equal the reference (``sr.run`` donates copies of its shards)."""
    case = random_case(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = check_case(case, simulated, donate=range(len(case.inputs)))
    assert program.donated == set(range(len(case.inputs)))


LOOP_CASES = 300


@settings(max_examples=LOOP_CASES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.integers(min_value=0, max_value=2**31 - 1))
def test_random_programs_ending_in_loops_match_reference(seed):
    """Cases ending in scans and while loops whose bodies make, hand on, take from xs, swap or share their
    carries (the carries a body owns are updated in place: partition/loops.py), every other seed with every
    input donated."""
    case = random_case(seed, loops=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_case(case, simulated, donate=range(len(case.inputs)) if seed % 2 else ())


# Windowed einsum on random einsums: random specs (batch, contracted, kept and summed-away letters), sizes
# (uneven too), shardings and meshes; under a cost model whose permutes cost nothing, every einsum next to a
# gather or reduce-scatter that a ring can replace becomes one (and the planner's exchanges are free).
FREE_PERMUTES = CostModel("free permutes", tuple(("collective_permute", k, 0.0, 0.0) for k in (2, 3, 4, 6, 8)))
WINDOWED_SEEDS = range(400)
_rings = []


def random_einsum_case(seed):
    rng = np.random.default_rng(seed)
    mesh = random_mesh(rng)
    letters = "abcde"[:int(rng.integers(2, 6))]
    while True:
        ta = "".join(c for c in letters if rng.random() < 0.6)
        tb = "".join(c for c in letters if rng.random() < 0.6)
        if ta and tb and set(ta) | set(tb) == set(letters):
            break
    out = "".join(c for c in rng.permutation(list(letters)) if rng.random() < 0.6)
    sizes = {c: int(rng.choice([1, 2, 3, 4, 5, 6, 7, 8, 12])) for c in letters}
    shapes = [tuple(sizes[c] for c in t) for t in (ta, tb)]
    spec = f"{ta},{tb}->{out}"
    graph = sr.trace(lambda x, y: snp.einsum(spec, x, y), *[sr.TensorSpec(s, "float64") for s in shapes])
    in_specs = [random_sharding(rng, mesh, len(s)) for s in shapes]
    out_specs = [random_sharding(rng, mesh, len(out)) if out and rng.random() < 0.7 else None]
    inputs = [rng.standard_normal(s) for s in shapes]
    return FuzzCase(seed, mesh, graph, inputs, in_specs, out_specs)


@pytest.mark.parametrize("seed", WINDOWED_SEEDS)
def test_random_windowed_einsums_match_reference(seed):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = check_case(random_einsum_case(seed), simulated, windowed_einsum=0, cost_profile=FREE_PERMUTES)
    _rings.append(any(i.op == "rotated_concat" or i.attrs.get("shift") for i in program.instrs))


def test_the_windowed_fuzz_cases_hold_rings():
    """The cases above exercise the rings (they ran first, in file order): at least one in ten."""
    if len(_rings) < len(WINDOWED_SEEDS):
        pytest.skip("run with the windowed fuzz cases")
    assert sum(_rings) >= len(_rings) // 10, f"{sum(_rings)} of {len(_rings)} cases hold a ring"
