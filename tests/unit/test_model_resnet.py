"""models/resnet.py (a BasicBlock ResNet on the public API) against the NumPy ResNet of tests/resnet_reference.py:
logits, loss, the batch-norm running statistics and every gradient (directional central differences of the
reference in float64, x64 on), at 1 rank and on simulated 4-rank meshes: the batch split (one image per rank:
batch norm's statistics must be the whole batch's), the block channels split Megatron-style, and the images
split spatially (rows over 4 ranks, uneven after the strides); the training step (``resnet.train_step``) under
dp, fsdp and megatron on an uneven batch equal to the 1-rank step, and its refusals of the other presets."""
import numpy as np
import pytest

import spmd_runtime as sr
from spmd_runtime import pytree
from spmd_runtime.comm import run_simulated
from spmd_runtime.models import resnet
from spmd_runtime.train import model_layout, train_mesh

import resnet_cases
import resnet_reference as ref
from simulated import collectives, run_everywhere

CFG = resnet.ResNetConfig(widths=(4, 6), blocks=(1, 1), num_classes=5)
BATCH, SIZE = 4, 12


@pytest.fixture
def x64():
    before = sr.config.enable_x64
    sr.config.update("enable_x64", True)
    yield
    sr.config.update("enable_x64", before)


def data(dtype="float64", seed=0):
    rng = np.random.default_rng(seed)
    params, stats = resnet.init(CFG, seed, dtype)
    params = {n: (w + 0.2 * rng.standard_normal(w.shape)).astype(dtype) for n, w in params.items()}
    stats = {n: (s + 0.1 * rng.random(s.shape)).astype(dtype) for n, s in stats.items()}
    images = rng.standard_normal((BATCH, CFG.in_channels, SIZE, SIZE)).astype(dtype)
    labels = rng.integers(0, CFG.num_classes, BATCH).astype("int32")
    return params, stats, images, labels


def run(mesh, preset, params, stats, images, labels, image_spec=None, features=None, train=True):
    """((loss, new stats), grads) of resnet.loss on ``mesh``, partitioned once, every rank's outputs equal."""
    layout = model_layout(mesh, preset, resnet.param_shapes(CFG), resnet.param_roles(CFG))
    annotate = (lambda x, role: sr.mesh_split(x, features)) if features else resnet.no_annotation

    def fn(p, s, x, y):
        return sr.value_and_grad(lambda p: resnet.loss(CFG, p, s, x, y, train, annotate), has_aux=True)(p)
    batch = sr.P(*layout.specs["batch.tokens"][:1])
    in_specs = ({n: sr.P(*v) for n, v in layout.param_specs().items()}, sr.P(), image_spec or batch, batch)
    program = sr.jit(fn, mesh=mesh, in_specs=in_specs).lower(params, stats, images, labels)
    args = (params, stats, images, labels)
    outs = run_everywhere(program, *pytree.flatten(args)[0])
    for rank, other in enumerate(outs[1:], 1):
        for a, b in zip(outs[0], other):
            np.testing.assert_array_equal(a, b, err_msg=f"rank {rank}")
    out_tree = pytree.flatten(((0.0, stats), params))[1]
    return out_tree.unflatten(outs[0]), set(collectives(program))


@pytest.fixture(scope="module")
def reference():
    params, stats, images, labels = data()
    rng = np.random.default_rng(3)
    directions = {n: rng.standard_normal(w.shape) for n, w in params.items()}
    _, new_stats = ref.forward(CFG, params, stats, images)
    return (params, stats, images, labels, ref.loss(CFG, params, stats, images, labels), new_stats, directions,
            ref.directional_derivatives(CFG, params, stats, images, labels, directions))


def check(result, reference):
    ((value, new_stats), grads), _ = result
    params, _, _, _, want_loss, want_stats, directions, derivatives = reference
    np.testing.assert_allclose(float(value), want_loss, rtol=1e-11)
    assert set(new_stats) == set(want_stats) and set(grads) == set(params)
    for name, s in new_stats.items():
        np.testing.assert_allclose(np.asarray(s), want_stats[name], rtol=1e-11, atol=1e-13, err_msg=name)
    for name, g in grads.items():
        np.testing.assert_allclose(float(np.sum(np.asarray(g) * directions[name])), derivatives[name], rtol=1e-6,
                                   atol=1e-9, err_msg=name)


def test_logits_match_numpy_in_float32_train_and_eval():
    params, stats, images, labels = data("float32")
    p64, s64 = ({n: w.astype("float64") for n, w in d.items()} for d in (params, stats))
    with train_mesh(1, "dp"):
        for train in (True, False):
            logits, new = sr.jit(lambda p, s, x: resnet.resnet(CFG, p, s, x, train))(params, stats, images)
            want, want_stats = ref.forward(CFG, p64, s64, images.astype("float64"), train)
            assert np.asarray(logits).dtype == np.float32
            np.testing.assert_allclose(np.asarray(logits), want, rtol=1e-4, atol=1e-5)
            for name, s in new.items():
                np.testing.assert_allclose(np.asarray(s), want_stats[name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.fixture(scope="module")
def one_rank(reference):
    before = sr.config.enable_x64
    sr.config.update("enable_x64", True)
    try:
        return run(train_mesh(1, "dp"), "dp", *reference[:4])
    finally:
        sr.config.update("enable_x64", before)


def test_loss_stats_and_every_gradient_at_one_rank(reference, one_rank):
    check(one_rank, reference)


SPATIAL = sr.P("data", None, "model", None)  # rows of every image (and activation) split over "model"
CASES = {
    "dp-2x2": (("dp", (2, 2)), {}),  # one image per rank
    "megatron-2x2": (("megatron", (2, 2)), {}),
    "spatial-2x2": (("dp", (2, 2)), {"image_spec": SPATIAL, "features": SPATIAL}),
    "spatial-1x4": (("dp", (1, 4)), {"image_spec": SPATIAL, "features": SPATIAL}),
}


@pytest.mark.parametrize("case", CASES)
def test_loss_stats_and_every_gradient_on_four_ranks(x64, reference, one_rank, case):
    (preset, shape), opts = CASES[case]
    mesh = sr.Mesh(shape, ("data", "model"))
    result = run(mesh, preset, *reference[:4], **opts)
    check(result, reference)
    for name, g in result[0][1].items():
        np.testing.assert_allclose(np.asarray(g), np.asarray(one_rank[0][1][name]), rtol=1e-9, atol=1e-12,
                                   err_msg=name)
    kinds = result[1]
    assert (("all_reduce", ("model",)) in kinds) == (preset == "megatron")  # conv2's partial sums over channels
    assert any(k == "collective_permute" and "model" in axes for k, axes in kinds) == ("spatial" in case)  # halos


def test_names_and_roles_are_torchvisions():
    shapes, roles = resnet.param_shapes(CFG), resnet.param_roles(CFG)
    assert list(shapes)[:3] == ["conv1.weight", "bn1.weight", "bn1.bias"]
    assert shapes["layer2.0.downsample.0.weight"] == (6, 4, 1, 1) and "layer1.0.downsample.0.weight" not in shapes
    assert roles["layer1.0.conv1.weight"].tensor == 0 and roles["layer1.0.conv2.weight"].tensor == 1
    assert roles["conv1.weight"].tensor is None and roles["fc.weight"].tensor is None
    assert list(resnet.stats_shapes(CFG))[:2] == ["bn1.running_mean", "bn1.running_var"]


def test_bad_config_says_what():
    with pytest.raises(ValueError, match="one block count per stage width; got widths=\\(4, 8\\), blocks=\\(1,\\)"):
        resnet.ResNetConfig(widths=(4, 8), blocks=(1,))


# ================================================================ the training step (models.resnet.train_step)
@pytest.fixture(scope="module")
def one_rank_steps():
    return resnet_cases.steps("dp", (1,))


@pytest.mark.parametrize("preset,shape", [("dp", (2, 2)), ("fsdp", (4,)), ("megatron", (2, 2))], ids=str)
def test_train_step_follows_one_rank_on_an_uneven_batch(one_rank_steps, preset, shape):
    """AdamW steps of 5 images (2, 2, 1, 0 per rank under dp and fsdp, 3 and 2 under megatron): the losses, updated
    parameters and BN running statistics are the 1-rank step's (per-rank statistics would move the running ones)."""
    results = run_simulated(4, lambda comm: resnet_cases.steps(preset, shape, comm))
    for rank, got in enumerate(results):
        resnet_cases.assert_same_step(got, one_rank_steps, f"{preset} rank {rank}")
    assert one_rank_steps[0][1] < one_rank_steps[0][0]  # it learns


def test_train_step_refuses_the_pipeline_and_sequence_presets_naming_why():
    with pytest.raises(ValueError, match="a ResNet's stages differ \\(widths \\(4, 6\\).*no uniform stages to cut"):
        resnet_cases.program("pipeline", (2, 1, 2))
    with pytest.raises(ValueError, match="splits the sequence dim over \\('model',\\); a ResNet's .* images have none"):
        resnet_cases.program("megatron_sp", (2, 2))
