"""The ResNet training step (``models.resnet.train_step``) as its unit and MPI tests run it: a small config, an
AdamW optimizer, data with a batch that does not divide over 4 ranks, and ``steps``: a few steps of one preset
on one mesh, returning the losses, the updated parameters and the BN running statistics (every one global)."""
import numpy as np

import spmd_runtime as sr
from spmd_runtime.graph import TensorSpec
from spmd_runtime.models import resnet
from spmd_runtime.optim import AdamW
from spmd_runtime.train import model_layout, train_mesh

CFG = resnet.ResNetConfig(widths=(4, 6), blocks=(1, 1), num_classes=5)
BATCH, SIZE, STEPS = 5, 12, 2  # 5 images: 3, 2 per rank on 2 data ranks; 2, 2, 1, 0 on 4 (blocks of ceil(5 / 4))
OPT = AdamW(lr=1e-2, weight_decay=0.1)


def data(seed=0, steps=STEPS):
    """(params, stats, [(images, labels)] * steps): torchvision's init moved off its special values (BN weight
    1, bias 0, running mean 0 and variance 1), so every term counts."""
    rng = np.random.default_rng(seed)
    params, stats = resnet.init(CFG, seed)
    params = {n: (w + 0.2 * rng.standard_normal(w.shape)).astype("float32") for n, w in params.items()}
    stats = {n: (s + 0.1 * rng.random(s.shape)).astype("float32") for n, s in stats.items()}
    batches = [(rng.standard_normal((BATCH, CFG.in_channels, SIZE, SIZE)).astype("float32"),
                rng.integers(0, CFG.num_classes, BATCH).astype("int32")) for _ in range(steps)]
    return params, stats, batches


def program(preset: str, shape, comm=None, cfg=CFG):
    """The step of ``cfg`` jitted under ``preset`` on ``train_mesh(shape, preset)``: (jitted step, layout)."""
    mesh = train_mesh(shape, preset)
    shapes = resnet.param_shapes(cfg)
    layout = model_layout(mesh, preset, shapes, resnet.param_roles(cfg), OPT.state_layout(shapes, "float32"))
    specs = resnet.step_in_specs(cfg, layout, OPT.init_state({n: TensorSpec(s, "float32") for n, s in shapes.items()}))
    return sr.jit(resnet.train_step(cfg, OPT, layout), mesh=mesh, in_specs=specs, comm=comm), layout


def steps(preset: str, shape, comm=None, seed=0):
    """(losses, params, stats) after ``STEPS`` steps under ``preset`` on ``shape``, all global NumPy."""
    params, stats, batches = data(seed)
    step, _ = program(preset, shape, comm)
    state, losses = OPT.init_state(params), []
    for images, labels in batches:
        params, stats, state, loss = step(params, stats, state, images, labels)
        losses.append(float(np.asarray(loss)))
    return np.array(losses), {n: np.asarray(w) for n, w in params.items()}, {n: np.asarray(s) for n, s in stats.items()}


def assert_same_step(got, want, where: str):
    """Losses, parameters and running statistics equal to float32 rounding (sums over the batch in another order);
    AdamW's update divides by sqrt(v), so a parameter whose gradient is near zero may move by a fraction of lr
    more: every element within the steps' bound on an update, STEPS lr."""
    (losses, params, stats), (want_losses, want_params, want_stats) = got, want
    np.testing.assert_allclose(losses, want_losses, rtol=2e-6, err_msg=where)
    for name, s in want_stats.items():
        np.testing.assert_allclose(stats[name], s, rtol=1e-5, atol=1e-6, err_msg=f"{where} {name}")
    for name, w in want_params.items():
        off = ~np.isclose(params[name], w, rtol=1e-4, atol=1e-5)
        assert off.mean() <= 1e-2, (where, name, int(off.sum()), off.size)
        np.testing.assert_allclose(params[name], w, rtol=0, atol=STEPS * OPT.lr, err_msg=f"{where} {name}")
