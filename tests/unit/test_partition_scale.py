"""Partitioning independent of the world size (issue 26): a training step planned on a 3072-rank mesh from
abstract shapes in well under a second, without the planner ever walking the ranks: no per-rank lookup of
the mesh, and the block exchange asked only for the coordinates of its own group (what both shardings split),
never one entry per rank. (The planner before built every exchange's table over all N ranks: N coordinate
lookups per exchange, N^2 rounds.)"""
import collections
import itertools

import pytest

import spmd_runtime as sr
from spmd_runtime.mesh import Mesh
from spmd_runtime.partition import exchange, partition
from spmd_runtime.train import as_preset, input_specs, make_layout, step_specs, train_step_fn

RANK_LOOKUPS = ("coords", "rank_at", "index_along", "groups")


@pytest.fixture
def asked(monkeypatch):
    """Counts of per-rank mesh lookups and of the coordinate tuples the exchange planner enumerates."""
    calls = collections.Counter()
    for name in RANK_LOOKUPS:
        def counted(*args, _f=getattr(Mesh, name), _name=name, **kwargs):
            calls[_name] += 1
            return _f(*args, **kwargs)
        monkeypatch.setattr(Mesh, name, counted)
    groups = exchange._Layout._groups

    def counted_groups(self, axes, fixed=()):
        for g in groups(self, axes, fixed):
            calls["exchange coordinates"] += 1
            yield g
    monkeypatch.setattr(exchange._Layout, "_groups", counted_groups)
    exchange._cost.cache_clear()
    return calls


def test_the_lm_step_partitions_on_3072_ranks_without_walking_them(asked):
    mesh = sr.train_mesh((384, 8), "megatron")
    cfg = sr.LMConfig(layers=1, d=64, heads=4, ffn=128, vocab=128, seq=16, batch=8, scan_layers=False)
    optimizer = sr.AdamW()
    layout = make_layout(cfg, mesh, as_preset("megatron").on(mesh), optimizer)
    graph = sr.trace(train_step_fn(cfg, optimizer, layout), *input_specs(cfg, optimizer))
    in_specs, out_specs = step_specs(graph, layout)
    asked.clear()
    program = partition(graph, mesh, in_specs=in_specs, out_specs=out_specs)
    assert len(program.instrs) > 100
    assert asked["exchange coordinates"] > 0  # the search did price block exchanges
    assert sum(asked.values()) < mesh.size // 8, dict(asked)  # not one per rank: the old planner asked >> N


@pytest.mark.parametrize("src,dst,group", [
    ((("data", "model"), ()), ((), ()), 1),  # to replicated: nothing both split, one class of receivers
    (((), ("model",)), (("model",), ()), 8),  # a transpose over the model axis: its 8 coordinates
    ((("data",), ("model",), ()), (("data",), (), ()), 384),  # gathered over model, data kept: its 384
])
def test_an_exchange_is_priced_over_its_own_group(asked, src, dst, group):
    mesh = Mesh((384, 8), ("data", "model"))
    shape = tuple(itertools.islice(itertools.cycle((16, 1000, 24)), len(src)))
    cost = exchange.exchange_cost(src, dst, shape, mesh)
    assert cost.busiest > 0
    assert asked["exchange coordinates"] <= (1 + len(shape)) * group, dict(asked)  # each, and its target per dim
    assert not any(asked[n] for n in RANK_LOOKUPS), dict(asked)
