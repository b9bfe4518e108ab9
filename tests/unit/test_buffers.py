"""Buffers kept across runs: a collective whose result cannot leave the run refills one receive buffer;
outputs never are (or view) a kept buffer, so a second run leaves the first run's outputs intact."""
import numpy as np

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from spmd_runtime.comm import run_simulated
from spmd_runtime.exec.buffers import output_buffers
from spmd_runtime.exec.runner import shard

MESH = sr.Mesh((4,), ("data",))
SPEC = sr.TensorSpec((8, 6), "float32")


def gathered(fn, out_ndims):
    """``fn`` on x split over data, outputs replicated: the program ends in all_gathers."""
    return sr.partition(sr.trace(fn, SPEC), MESH, in_specs=[("data", None)],
                        out_specs=[(None,) * n for n in out_ndims])


def gathers(program):
    return {i.out for i in program.instrs if i.op in ("all_gather", "all_gather_done")}  # a done owns the result


def test_output_buffers_are_the_collectives_an_output_is_or_views():
    direct = gathered(lambda x: (snp.tanh(x), snp.tanh(x).T), (2, 2))  # returned, and returned through a view
    assert gathers(direct) and gathers(direct) <= output_buffers(direct)
    consumed = gathered(lambda x: snp.sum(snp.tanh(x) @ snp.tanh(x).T, axis=0), (1,))
    inner = gathers(consumed)
    assert inner and not inner & output_buffers(consumed)  # gathered operand of a matmul: kept across runs


def test_outputs_of_a_run_survive_the_next_run():
    program = gathered(lambda x: (snp.tanh(x) * 2.0, (snp.tanh(x) * 2.0).T), (2, 2))
    first, second = [np.random.default_rng(s).standard_normal((8, 6)).astype(np.float32) for s in (0, 1)]

    def body(comm):
        block = lambda x: shard(x, program.inputs[0].sharding, MESH, comm.Get_rank())
        outs = sr.run_local(program, block(first), comm=comm)
        kept = [o.copy() for o in outs]
        sr.run_local(program, block(second), comm=comm)
        return [np.array_equal(o, k) for o, k in zip(outs, kept)] + [np.allclose(kept[0], np.tanh(first) * 2)]

    assert all(all(same) for same in run_simulated(MESH.size, body))
