"""A small ResNet (He et al. 2015: torchvision's BasicBlock ResNet, sized for 32 x 32 images) written on the
public API as jax code would be: ``spmd_runtime.lax`` for the convolutions and pooling, ``spmd_runtime.numpy``
as snp, ``spmd_runtime.nn`` as snn.

The model: a 3 x 3 stem convolution, batch norm, ReLU and (``stem_pool``) a 3 x 3 / 2 max-pool; then stages of
BasicBlocks (conv 3 x 3, BN, ReLU, conv 3 x 3, BN, plus the shortcut, ReLU), every stage after the first
halving the resolution with stride 2 and a 1 x 1 convolution + BN on its first shortcut; a global average
pool and a linear classifier. Layouts are PyTorch's: images NCHW, kernels OIHW, Linear [out, in], and the
names torchvision's (``conv1.weight``, ``bn1.weight`` / ``bn1.bias``, ``layer{s}.{b}.conv1.weight``,
``layer{s}.{b}.downsample.0.weight`` / ``downsample.1.*``, ``fc.weight`` / ``fc.bias``); the BN running
statistics (``*.running_mean`` / ``*.running_var``) are a dict of their own (flax's ``batch_stats``), passed in
and returned updated in training.

Batch norm in training normalises by the mean and variance over the batch and both spatial dims. They are
plain ``snp.mean`` reductions of the global batch, so where the batch (or the image) is split over ranks the
partitioner reduces them over those ranks: the statistics are the whole batch's on any mesh (cross-replica /
synchronised batch norm), never a shard's.

Sharding hints (``param_roles``): inside each block the first convolution's output channels and the second's
input channels form a tensor-parallel pair (Megatron's column / row split: conv1 and bn1 split by channel, the
partial sums of conv2 all-reduced); the stem, shortcuts and classifier are replicated. ``annotate(x, role)``
may pin activations (role 'features': every (N, C, H, W) block input), e.g. to split the images spatially.

Training (``train_step``, ``step_in_specs``): one step of the loss, its gradient and the optimizer's update with
the running statistics updated, laid out by a training preset's ``train.model_layout`` of ``param_shapes`` /
``param_roles``: dp (the batch split, batch norm's statistics the whole batch's), fsdp and wus (weights or
update sharded), megatron (the block channels split). The pipeline presets and those that split a sequence
are refused, naming why (``check_preset``).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .. import lax
from .. import nn as snn
from .. import numpy as snp
from .. import pytree
from ..autodiff import value_and_grad
from ..sharding import P
from .roles import NORM, ParamRole

CONV = ParamRole("convolution kernel [out, in, kh, kw]")  # replicated
CONV_COLUMN = ParamRole("column-parallel convolution [out, in, kh, kw]", tensor=0)  # output channels split
CONV_ROW = ParamRole("row-parallel convolution [out, in, kh, kw]", tensor=1)  # input channels split; partial sums
CHANNELS = ParamRole("per-channel BN parameter of a column-parallel convolution", tensor=0)
LINEAR = ParamRole("classifier [out, in] or its bias")  # replicated


@dataclass(frozen=True)
class ResNetConfig:
    in_channels: int = 3
    widths: tuple = (16, 32, 64)  # channels of each stage
    blocks: tuple = (1, 1, 1)  # BasicBlocks per stage
    num_classes: int = 10
    stem_pool: bool = True  # torchvision's 3 x 3 / 2 max-pool after the stem
    bn_eps: float = 1e-5
    bn_momentum: float = 0.1  # PyTorch's: running = (1 - m) running + m batch (the variance unbiased)

    def __post_init__(self):
        if len(self.widths) != len(self.blocks) or not self.widths:
            raise ValueError(f"ResNetConfig needs one block count per stage width; got widths={self.widths}, "
                             f"blocks={self.blocks}")
        for name, values in (("widths", self.widths), ("blocks", self.blocks)):
            if any(not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"ResNetConfig.{name} must be positive ints; got {values}")


def block_names(cfg: ResNetConfig):
    """(prefix, in channels, out channels, stride) of every BasicBlock in order."""
    out, c_in = [], cfg.widths[0]
    for s, (width, count) in enumerate(zip(cfg.widths, cfg.blocks)):
        for b in range(count):
            out.append((f"layer{s + 1}.{b}.", c_in, width, 2 if (s > 0 and b == 0) else 1))
            c_in = width
    return out


def _bn(prefix: str, c: int, roles, shapes, role=NORM):
    for k in ("weight", "bias"):
        shapes[prefix + k], roles[prefix + k] = (c,), role


def param_shapes_and_roles(cfg: ResNetConfig):
    shapes, roles = OrderedDict(), OrderedDict()
    shapes["conv1.weight"], roles["conv1.weight"] = (cfg.widths[0], cfg.in_channels, 3, 3), CONV
    _bn("bn1.", cfg.widths[0], roles, shapes)
    for prefix, c_in, c_out, stride in block_names(cfg):
        shapes[prefix + "conv1.weight"], roles[prefix + "conv1.weight"] = (c_out, c_in, 3, 3), CONV_COLUMN
        _bn(prefix + "bn1.", c_out, roles, shapes, CHANNELS)
        shapes[prefix + "conv2.weight"], roles[prefix + "conv2.weight"] = (c_out, c_out, 3, 3), CONV_ROW
        _bn(prefix + "bn2.", c_out, roles, shapes)
        if stride != 1 or c_in != c_out:
            shapes[prefix + "downsample.0.weight"], roles[prefix + "downsample.0.weight"] = (c_out, c_in, 1, 1), CONV
            _bn(prefix + "downsample.1.", c_out, roles, shapes)
    shapes["fc.weight"], roles["fc.weight"] = (cfg.num_classes, cfg.widths[-1]), LINEAR
    shapes["fc.bias"], roles["fc.bias"] = (cfg.num_classes,), LINEAR
    return shapes, roles


def param_shapes(cfg: ResNetConfig) -> "OrderedDict[str, tuple]":
    """Trainable parameter name -> shape (torchvision's state_dict order, running statistics apart)."""
    return param_shapes_and_roles(cfg)[0]


def param_roles(cfg: ResNetConfig) -> "OrderedDict[str, ParamRole]":
    return param_shapes_and_roles(cfg)[1]


def stats_shapes(cfg: ResNetConfig) -> "OrderedDict[str, tuple]":
    """BN running statistic name -> shape: ``<bn>.running_mean`` and ``<bn>.running_var`` of every BN."""
    out = OrderedDict()
    for name, shape in param_shapes(cfg).items():
        if name.endswith(".bias") and not name.startswith("fc."):
            bn = name[:-len("bias")]
            out[bn + "running_mean"], out[bn + "running_var"] = shape, shape
    return out


def init(cfg: ResNetConfig, seed: int = 0, dtype="float32"):
    """(params, stats) as torchvision initialises them: kernels He-normal (fan_out, ReLU), BN weight 1 and
    bias 0, the classifier uniform(+-1/sqrt(fan_in)); running mean 0 and variance 1. Plain dicts."""
    rng = np.random.default_rng(seed)
    params = {}
    for name, shape in param_shapes(cfg).items():
        if len(shape) == 4:
            params[name] = rng.normal(0.0, np.sqrt(2.0 / (shape[0] * shape[2] * shape[3])), shape).astype(dtype)
        elif name.startswith("fc."):
            bound = 1.0 / np.sqrt(cfg.widths[-1])
            params[name] = rng.uniform(-bound, bound, shape).astype(dtype)
        else:
            params[name] = (np.ones if name.endswith("weight") else np.zeros)(shape, dtype)
    stats = {n: (np.zeros if n.endswith("mean") else np.ones)(s, dtype) for n, s in stats_shapes(cfg).items()}
    return params, stats


# ================================================================ the model
def no_annotation(x, role):
    return x


def conv2d(x, w, stride: int = 1, padding: int = 1):
    """PyTorch's F.conv2d without bias: NCHW images, OIHW kernel."""
    return lax.conv_general_dilated(x, w, (stride, stride), [(padding, padding)] * 2)


def max_pool(x, window: int = 3, stride: int = 2, padding: int = 1):
    """F.max_pool2d over the spatial dims of NCHW ``x`` (padding never wins)."""
    return lax.reduce_window(x, -snp.inf, lax.max, (1, 1, window, window), (1, 1, stride, stride),
                             ((0, 0), (0, 0), (padding, padding), (padding, padding)))


def channel(v):
    """A per-channel (C,) vector shaped to broadcast over NCHW."""
    return v.reshape(1, -1, 1, 1)


def batch_norm(cfg: ResNetConfig, x, params: dict, stats: dict, prefix: str, train: bool, new_stats: dict):
    """BatchNorm2d: with ``train``, normalise by the batch's mean and (biased) variance over N, H, W and put
    the updated running statistics (unbiased variance, PyTorch's momentum) in ``new_stats``; otherwise by
    the running statistics."""
    if train:
        mean = snp.mean(x, axis=(0, 2, 3))
        var = snp.mean((x - channel(mean)) ** 2, axis=(0, 2, 3))
        n = x.size // x.shape[1]
        m = cfg.bn_momentum
        new_stats[prefix + "running_mean"] = (1 - m) * stats[prefix + "running_mean"] + m * mean
        new_stats[prefix + "running_var"] = (1 - m) * stats[prefix + "running_var"] + m * var * (n / max(n - 1, 1))
    else:
        mean, var = stats[prefix + "running_mean"], stats[prefix + "running_var"]
    scale = params[prefix + "weight"] * snp.rsqrt(var + cfg.bn_eps)
    return (x - channel(mean)) * channel(scale) + channel(params[prefix + "bias"])


def basic_block(cfg, params, stats, x, prefix, stride, train, new_stats, annotate=no_annotation):
    x = annotate(x, "features")
    out = snn.relu(batch_norm(cfg, conv2d(x, params[prefix + "conv1.weight"], stride), params, stats,
                              prefix + "bn1.", train, new_stats))
    out = batch_norm(cfg, conv2d(out, params[prefix + "conv2.weight"]), params, stats, prefix + "bn2.", train,
                     new_stats)
    shortcut = x
    if prefix + "downsample.0.weight" in params:
        shortcut = batch_norm(cfg, conv2d(x, params[prefix + "downsample.0.weight"], stride, padding=0), params,
                              stats, prefix + "downsample.1.", train, new_stats)
    return snn.relu(out + shortcut)


def resnet(cfg: ResNetConfig, params: dict, stats: dict, images, train: bool = True, annotate=no_annotation):
    """(logits (N, num_classes), new running statistics) of NCHW ``images``; in eval (``train=False``) the
    statistics come back unchanged."""
    new_stats = {}
    x = conv2d(annotate(images, "features"), params["conv1.weight"])
    x = snn.relu(batch_norm(cfg, x, params, stats, "bn1.", train, new_stats))
    if cfg.stem_pool:
        x = max_pool(x)
    for prefix, _, _, stride in block_names(cfg):
        x = basic_block(cfg, params, stats, x, prefix, stride, train, new_stats, annotate)
    pooled = snp.mean(x, axis=(2, 3))  # global average pool
    logits = pooled @ params["fc.weight"].T + params["fc.bias"]
    return logits, (new_stats if train else dict(stats))


def loss(cfg: ResNetConfig, params: dict, stats: dict, images, labels, train: bool = True,
         annotate=no_annotation):
    """(mean cross-entropy, new running statistics): ``sr.value_and_grad(..., has_aux=True)`` takes it."""
    logits, new_stats = resnet(cfg, params, stats, images, train, annotate)
    return snn.cross_entropy(logits, labels), new_stats


# ================================================================ training
def check_preset(cfg: ResNetConfig, preset) -> None:
    """The presets a ResNet trains under: not the pipelines (they cut a stack of identical layers held on a leading
    layer dim into stages; the ResNet's blocks are held one by one under torchvision's names and its stages are
    not alike: each after the first halves the resolution, widens the channels and opens with a downsampling
    block), not those that split a sequence (an image has none: split its rows with ``annotate`` instead), not
    the expert ones (no expert weights)."""
    if preset.stage:
        raise ValueError(f"preset {preset.name!r} pipelines stacked layers of one shape; a ResNet's stages differ "
                         f"(widths {cfg.widths}, each stage after the first at half the resolution and opening with a "
                         f"stride-2 downsampling block), so there are no uniform stages to cut. Use dp, fsdp, wus "
                         f"or megatron")
    if preset.seq:
        raise ValueError(f"preset {preset.name!r} splits the sequence dim over {preset.seq}; a ResNet's (N, C, H, W) "
                         f"images have none (split their rows spatially with annotate). Use dp, fsdp, wus or "
                         f"megatron")
    if preset.experts:
        raise ValueError(f"preset {preset.name!r} splits experts; a ResNet has no expert weights")


def train_step(cfg: ResNetConfig, optimizer, layout, annotate=no_annotation):
    """``step(params, stats, opt_state, images, labels) -> (new params, new stats, new opt_state, loss)``: batch
    norm in training mode (the statistics of the whole batch on any mesh), ``value_and_grad`` of ``loss`` and
    ``optimizer.update`` (weight decay on the kernels and the classifier's matrix). ``layout``: a training
    preset's ``train.model_layout(mesh, preset, param_shapes(cfg), param_roles(cfg), optimizer.state_layout(...))``:
    the weights used as it lays them out (fsdp gathers them), the gradients, new weights and optimizer state
    pinned to their update / held specs. Jit it with ``step_in_specs``."""
    check_preset(cfg, layout.preset)
    matrices = {n for n, shape in param_shapes(cfg).items() if len(shape) >= 2}

    def step(params, stats, opt_state, images, labels):
        def objective(p):
            return loss(cfg, p, stats, images, labels, True, annotate)
        (value, new_stats), grads = value_and_grad(objective, has_aux=True)(layout.used(params))
        grads = {n: layout.annotate(g, layout.update[n]) for n, g in grads.items()}
        new_params, new_state = optimizer.update(params, grads, opt_state, matrices)
        new_params = {n: layout.annotate(w, layout.specs[f"params.{n}"]) for n, w in new_params.items()}
        # replicated as they came in (the batch's sums completed), so the step iterates
        new_stats = {n: layout.annotate(s, (None,)) for n, s in new_stats.items()}
        return new_params, new_stats, layout.annotate_state(new_state), value
    return step


def step_in_specs(cfg: ResNetConfig, layout, opt_state) -> tuple:
    """The ``in_specs`` of ``train_step``'s step for ``sr.jit``: the parameters and optimizer state (``opt_state``:
    the optimizer's state tree, arrays or TensorSpecs) as ``layout`` holds them, the running statistics
    replicated, images and labels split over the preset's batch axes (unevenly where the batch does not divide)."""
    batch = layout.preset.batch or None
    paths, tree = pytree.flatten_with_path(opt_state)
    state = tree.unflatten(P(*layout.specs[pytree.keystr(path, "opt_state")]) for path, _ in paths)
    return ({n: P(*layout.specs[f"params.{n}"]) for n in param_shapes(cfg)}, {n: P() for n in stats_shapes(cfg)},
            state, P(batch, None, None, None), P(batch))


__all__ = ["ResNetConfig", "param_shapes", "param_roles", "stats_shapes", "init", "conv2d", "max_pool",
           "batch_norm", "basic_block", "resnet", "loss", "check_preset", "train_step", "step_in_specs"]
