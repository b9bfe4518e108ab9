"""GShard mixture of experts (models/moe.py): gating against a NumPy implementation written here from the
formulas; the partitioned layer's value and gradients against the reference evaluator on meshes of 1, 2, 4
and 8 simulated ranks (4 and 8 experts, uneven groups); the exact all-to-alls (one into the experts and one
back, forward and backward) with no all-gather of expert weights; the MoE LM presets; bad settings.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

import spmd_runtime as sr
import spmd_runtime.numpy as snp
from simulated import assert_all_ranks
from spmd_runtime.comm import run_simulated
from spmd_runtime.models.lm import LMConfig, param_shapes
from spmd_runtime.models.moe import MoEConfig, moe_ffn, top2_gating
from spmd_runtime.train import build_train_step, build_train_step_on_root, train_mesh
from spmd_runtime.cost import collective_kind


# ---------------------------------------------------------------- gating vs NumPy from the formulas
def numpy_gating(logits, cfg: MoEConfig, noise=None):
    """GShard top-k gating, token by token: (combine (G,S,E,C), dispatch, aux, dropped, routed)."""
    g_, s_, e_ = logits.shape
    cap = math.ceil(cfg.capacity_factor * cfg.top_k * s_ / e_)
    z = logits.astype(np.float32)
    probs = np.exp(z - z.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    combine, dispatch = np.zeros((g_, s_, e_, cap), np.float32), np.zeros((g_, s_, e_, cap), np.float32)
    aux, dropped, routed = 0.0, 0, 0
    for g in range(g_):
        order = np.argsort(-probs[g], axis=-1, kind="stable")
        first, second = order[:, 0], order[:, 1]
        fraction = np.bincount(first, minlength=e_) / s_
        aux += float(np.sum(fraction * probs[g].mean(0))) * e_ / g_  # E * sum_e f_e p_e, averaged over groups
        fill = np.zeros(e_, int)
        slot1 = {}
        for s in range(s_):  # first choices queue in token order
            routed += 1
            if fill[first[s]] < cap:
                slot1[s] = fill[first[s]]
                fill[first[s]] += 1
            else:
                dropped += 1
        slot2 = {}
        if cfg.top_k == 2:
            for s in range(s_):  # second choices queue behind every kept first choice
                g1, g2 = probs[g, s, first[s]], probs[g, s, second[s]]
                if cfg.second_policy == "random" and not noise[g, s] < g2 / (g1 + g2) / cfg.second_threshold:
                    continue
                routed += 1
                if fill[second[s]] < cap:
                    slot2[s] = fill[second[s]]
                    fill[second[s]] += 1
                else:
                    dropped += 1
        for s in range(s_):
            g1 = probs[g, s, first[s]] if s in slot1 else 0.0
            g2 = probs[g, s, second[s]] if s in slot2 else 0.0
            denom = (g1 + g2) if cfg.top_k == 2 and g1 + g2 > 0 else 1.0
            for e, slot, gate in ((first[s], slot1.get(s), g1), (second[s], slot2.get(s), g2)):
                if slot is not None:
                    combine[g, s, e, slot] = gate / denom
                    dispatch[g, s, e, slot] = 1.0
    return combine, dispatch, np.float32(aux), dropped, routed


GATING_CASES = [  # (G, S, E, top_k, capacity_factor, policy)
    (3, 16, 4, 2, 0.5, "all"),     # tight: many second (and some first) choices dropped
    (2, 12, 8, 2, 2.0, "all"),     # roomy: nothing dropped
    (2, 16, 4, 1, 0.75, "all"),    # Switch-style top-1, unnormalised gate
    (2, 16, 4, 2, 1.0, "random"),  # GShard random routing of the second expert
]


@pytest.mark.parametrize("g,s,e,k,factor,policy", GATING_CASES)
def test_gating_matches_numpy(g, s, e, k, factor, policy):
    cfg = MoEConfig(e, k, factor, policy)
    rng = np.random.default_rng(g * s + e)
    logits = rng.standard_normal((g, s, e)).astype(np.float32) * 2.0
    noise = rng.random((g, s)).astype(np.float32)

    def fn(z, u):
        out = top2_gating(z, cfg, u)
        return out.combine, out.dispatch, out.aux_loss, out.dropped, out.routed
    got = sr.evaluate(sr.trace(fn, logits, noise), logits, noise)
    combine, dispatch, aux, dropped, routed = numpy_gating(logits, cfg, noise)
    assert got[0].shape == (g, s, e, cfg.capacity(s)) == combine.shape
    np.testing.assert_allclose(got[0], combine, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got[1], dispatch)
    np.testing.assert_allclose(got[2], aux, rtol=1e-5)
    assert (int(got[3]), int(got[4])) == (dropped, routed)
    if factor < 1.0:
        assert dropped > 0, "a tight capacity must drop tokens"
    if k == 2:  # kept tokens' gates sum to 1 (renormalised); dropped-everywhere tokens to 0
        sums = combine.sum((2, 3))
        assert np.all((np.abs(sums - 1) < 1e-5) | (sums == 0))


def test_capacity_is_ceil_of_factor_k_s_over_e():
    assert MoEConfig(4, 2, 1.25).capacity(10) == math.ceil(1.25 * 2 * 10 / 4) == 7
    assert MoEConfig(8, 1, 0.5).capacity(12) == 1


def test_balanced_routing_has_aux_loss_one():
    """f = p = 1/E for every expert: E * sum_e f_e p_e = 1."""
    e, s = 4, 8
    logits = np.full((1, s, e), -5.0, np.float32)
    logits[0, np.arange(s), np.arange(s) % e] = 5.0  # each expert top-1 for s/E tokens, symmetric probs
    got = sr.evaluate(sr.trace(lambda z: top2_gating(z, MoEConfig(e)).aux_loss, logits), logits)[0]
    np.testing.assert_allclose(got, 1.0, rtol=1e-6)


# ---------------------------------------------------------------- the layer, partitioned
M, H = 8, 12


def layer_graph(mesh, roles, g, s, e, grad):
    cfg = MoEConfig(e, 2, 1.0)
    annotate = lambda x, role: sr.mesh_split(x, mesh, (roles[role] + (None,) * 4)[:x.ndim])

    def loss(x, wg, w1, w2):
        y, gating = moe_ffn(x, wg, w1, w2, cfg, annotate)
        return snp.sum(y * y) + gating.aux_loss

    fn = sr.value_and_grad(loss, argnums=(0, 1, 2, 3)) if grad else \
        (lambda x, wg, w1, w2: moe_ffn(x, wg, w1, w2, cfg, annotate)[0])
    rng = np.random.default_rng(g + e)
    args = [rng.standard_normal(shape) for shape in ((g, s, M), (M, e), (e, M, H), (e, H, M))]
    return sr.trace(fn, *args), args


def expert_parallel(mesh, expert_axis="data"):
    """GShard roles on ``mesh``: groups on every axis, the expert axis minor; experts on the expert axis."""
    rest = tuple(a for a in mesh.axis_names if a != expert_axis)
    return {"groups": (rest + (expert_axis,),), "expert_in": (expert_axis, rest or None),
            "expert_hidden": (expert_axis, rest or None), "expert_out": (None, rest + (expert_axis,))}


def partition_layer(mesh, g, e, grad, roles=None, s=8):
    roles = roles or expert_parallel(mesh)
    graph, args = layer_graph(mesh, roles, g, s, e, grad)
    experts = (roles["expert_in"][0], None, roles["expert_hidden"][3] if len(roles["expert_hidden"]) > 3 else None)
    program = sr.partition(graph, mesh, in_specs=[None, None, experts, (experts[0], experts[2], None)])
    return graph, program, args


LAYER_MESHES = [  # (mesh shape, axis names, groups, experts): 1, 2, 4 and 8 ranks, uneven groups
    ((1,), ("data",), 3, 4),
    ((2,), ("data",), 3, 4),
    ((4,), ("data",), 6, 8),
    ((2, 2), ("model", "data"), 6, 4),
    ((8,), ("data",), 10, 8),
    ((2, 4), ("model", "data"), 12, 4),
]


@pytest.mark.parametrize("shape,names,g,e", LAYER_MESHES)
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "grad"])
def test_layer_matches_reference(shape, names, g, e, grad):
    mesh = sr.Mesh(shape, names)
    graph, program, args = partition_layer(mesh, g, e, grad)
    assert_all_ranks(program, args, sr.evaluate(graph, *args), tol=2e-6)  # gating runs in float32


def collectives_of(program, min_bytes=8):
    """(kind, axes) of every collective moving more than a scalar, in program order."""
    return [(c["kind"], c["axes"]) for c in program.comm_summary() if c["bytes_in"] > min_bytes]


A2A = ("all_to_all", ("data",))
A2AV = ("all_to_allv", ("model", "data"))  # uneven groups: (model, data) -> model is a block exchange
EXPERT_PARTITION_CASES = [  # mesh, groups, experts, roles -> forward collectives, backward collectives
    ((4,), ("data",), 8, 4, None, [A2A, A2A], [A2A, A2A, ("all_reduce", ("data",))]),
    ((4,), ("data",), 6, 8, None, [A2A, A2A], [A2A, A2A, ("all_reduce", ("data",))]),
    ((2, 4), ("model", "data"), 8, 4, None, [A2A, A2A],  # the expert weight gradient made as [E, H, M] (no
     # transpose after its einsum) starts its all-reduce before the token gradient's all-to-all
     [A2A, ("all_reduce", ("model",)), A2A, ("all_reduce", ("model",)), ("all_reduce", ("model", "data"))]),
    ((2, 2), ("model", "data"), 6, 4, None, [A2AV, A2AV],
     [A2AV, ("all_reduce", ("model",)), ("all_reduce", ("model",)), A2AV, ("all_reduce", ("model", "data"))]),
    # Megatron experts: hidden dim on model; the second expert einsum's partial sum is all-reduced over it
    ((2, 2), ("data", "model"), 4, 4,
     {"groups": ("data",), "expert_in": ("data", None), "expert_hidden": ("data", None, None, "model"),
      "expert_out": (None, "data")},
     [A2A, ("all_reduce", ("model",)), A2A], [A2A, ("all_reduce", ("model",)), A2A, ("all_reduce", ("data",))]),
]


@pytest.mark.parametrize("shape,names,g,e,roles,forward,backward", EXPERT_PARTITION_CASES)
def test_one_all_to_all_each_way_and_no_gathered_experts(shape, names, g, e, roles, forward, backward):
    """The wg gradient's all-reduce and the expert weights' gradient all-reduce over the replica axis are
    the only other collectives; nothing is ever all-gathered."""
    mesh = sr.Mesh(shape, names)
    _, fwd, _ = partition_layer(mesh, g, e, grad=False, roles=roles)
    _, both, _ = partition_layer(mesh, g, e, grad=True, roles=roles)
    assert collectives_of(fwd) == forward
    assert collectives_of(both) == forward + backward
    assert not [i for i in both.instrs if collective_kind(i.op) == "all_gather"]


# ---------------------------------------------------------------- the MoE LM
MOE_CFG = LMConfig(layers=2, d=16, heads=4, ffn=64, vocab=24, seq=8, batch=8, dtype="float64", moe_every=2,
                   experts=4, capacity_factor=1.0)


@pytest.mark.parametrize("preset,shape,batch", [("moe", (2, 2), 6), ("moe_megatron", (2, 2), 8), ("moe", (4,), 6)])
def test_moe_lm_two_steps_match_reference(preset, shape, batch):
    cfg = dataclasses.replace(MOE_CFG, batch=batch)
    ts = build_train_step(cfg, train_mesh(shape, preset), preset, sr.AdamW(lr=1e-2))
    rng = np.random.default_rng(0)
    data = [(rng.integers(0, 24, (batch, 8)), rng.integers(0, 24, (batch, 8))) for _ in range(2)]
    state = ref = ts.init(1)
    want = []
    for x, y in data:
        ref, loss = ts.reference_step(ref, x, y)
        want.append((loss, ts.metrics["dropped_fraction"]))

    def body(comm):
        local, got = ts.shard_state(state, comm.Get_rank()), []
        for x, y in data:
            local, loss = ts.step(local, x, y, comm=comm)
            got.append((loss, ts.metrics["dropped_fraction"]))
        return ts.gather(local, comm), got
    # ts.metrics is per TrainStep object: the simulated ranks share one, so compare rank 0's after the run
    gathered, got = run_simulated(ts.mesh.size, body)[0]
    np.testing.assert_allclose(got, want, rtol=1e-9)
    assert any(d > 0 for _, d in want), "capacity 1.0 drops some tokens"
    gathered, ref = ts.named(gathered), ts.named(ref)
    for name in ref:
        np.testing.assert_allclose(gathered[name], ref[name], rtol=1e-8, atol=1e-10, err_msg=name)
    a2a = [g for g in ts.comm_summary() if g["kind"].startswith("all_to_all")]  # all_to_allv: uneven groups
    assert sum(g["count"] for g in a2a) == 4  # one MoE block: 2 forward, 2 backward


# The einsum chooser weighs bytes: with expert weights smaller than the expert activations (ffn <= d at
# this toy size) moe_megatron would rather all-gather a weight than all-reduce the activations; at ffn = 4d
# the weights stay put.
@pytest.mark.parametrize("preset,shape", [("moe", (2, 2)), ("moe_megatron", (2, 2))])
def test_expert_weights_are_split_never_gathered(preset, shape):
    ts = build_train_step(MOE_CFG, train_mesh(shape, preset), preset, sr.AdamW())
    experts = {io.name: io for io in ts.program.inputs if io.name.endswith(("_we1", "_we2"))}
    owners = ("params", "opt_state.m", "opt_state.v")  # + AdamW state
    assert set(experts) == {f"{pre}.l1_{w}" for pre in owners for w in ("we1", "we2")}
    split_h = 2 if preset == "moe_megatron" else 1
    for io in experts.values():
        local = io.sharding.local_shape(io.shape, ts.mesh)
        assert math.prod(local) * 2 * split_h == math.prod(io.shape)  # 1/E per rank on the expert axis of 2
    expert_shapes = {io.shape for io in experts.values()}
    assert not [i for i in ts.program.instrs if collective_kind(i.op) == "all_gather" and i.global_shape in expert_shapes]


def test_moe_blocks_every_other_layer():
    cfg = LMConfig(layers=4, d=8, heads=2, ffn=8, vocab=8, seq=4, batch=2, moe_every=2, experts=2)
    shapes = param_shapes(cfg)
    assert [i for i in range(4) if f"l{i}_wg" in shapes] == [1, 3]
    assert shapes["l1_we1"] == (2, 8, 8) and "l0_w1" in shapes and "l1_w1" not in shapes


def test_fewer_experts_than_expert_shards_raise_on_every_rank():
    cfg = LMConfig(layers=2, d=8, heads=2, ffn=8, vocab=8, seq=4, batch=4, moe_every=2, experts=2)

    def body(comm):
        with pytest.raises(ValueError, match=r"over mesh axes \('data',\) of size 4, which needs experts >= 4; "
                                             r"got experts=2"):
            build_train_step_on_root(cfg, train_mesh((4,), "moe"), "moe", sr.AdamW(), comm)
        return True
    assert run_simulated(4, body) == [True] * 4


@pytest.mark.parametrize("kwargs,match", [
    (dict(experts=1), "experts >= 2; got experts=1"),
    (dict(experts=4, capacity_factor=0.0), "capacity_factor must be > 0; got capacity_factor=0.0"),
    (dict(experts=2, top_k=3), "top_k must be <= experts; got top_k=3, experts=2"),
    (dict(experts=4, moe_every=5), "moe_every must be in"),
])
def test_bad_moe_settings_raise_on_every_rank(kwargs, match):
    base = dict(layers=2, d=8, heads=2, ffn=8, vocab=8, seq=4, batch=2, moe_every=2)

    def body(comm):
        with pytest.raises(ValueError, match=match):
            LMConfig(**{**base, **kwargs})
        return True
    assert run_simulated(4, body) == [True] * 4
