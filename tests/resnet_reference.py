"""A NumPy ResNet (torchvision's BasicBlock layout, NCHW / OIHW, names as spmd_runtime.models.resnet's) written
independently of the model, for its tests: logits, batch-norm running statistics and the loss, train or eval."""
import numpy as np


def conv2d(x, w, stride=1, padding=1):
    """Cross-correlation of NCHW x with an OIHW kernel, tap by tap."""
    n, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    ho, wo = (h + 2 * padding - kh) // stride + 1, (wd + 2 * padding - kw) // stride + 1
    out = np.zeros((n, o, ho, wo))
    for i in range(kh):
        for j in range(kw):
            patch = xp[:, :, i:i + stride * (ho - 1) + 1:stride, j:j + stride * (wo - 1) + 1:stride]
            out += np.einsum("nchw,oc->nohw", patch, w[:, :, i, j])
    return out


def max_pool(x, k=3, stride=2, padding=1):
    n, c, h, w = x.shape
    xp = np.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)), constant_values=-np.inf)
    ho, wo = (h + 2 * padding - k) // stride + 1, (w + 2 * padding - k) // stride + 1
    taps = [xp[:, :, i:i + stride * (ho - 1) + 1:stride, j:j + stride * (wo - 1) + 1:stride]
            for i in range(k) for j in range(k)]
    return np.max(taps, axis=0)


def batch_norm(cfg, x, p, stats, name, train, new):
    if train:
        mean, var = x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3))
        n = x.size / x.shape[1]
        m = cfg.bn_momentum
        new[name + "running_mean"] = (1 - m) * stats[name + "running_mean"] + m * mean
        new[name + "running_var"] = (1 - m) * stats[name + "running_var"] + m * x.var(axis=(0, 2, 3), ddof=1)
    else:
        mean, var = stats[name + "running_mean"], stats[name + "running_var"]
    shape = (1, -1, 1, 1)
    return (x - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + cfg.bn_eps) * p[name + "weight"].reshape(shape) \
        + p[name + "bias"].reshape(shape)


def relu(x):
    return np.maximum(x, 0)


def forward(cfg, p, stats, images, train=True):
    """(logits, new running statistics)."""
    new = {}
    x = relu(batch_norm(cfg, conv2d(images, p["conv1.weight"]), p, stats, "bn1.", train, new))
    if cfg.stem_pool:
        x = max_pool(x)
    c_in = cfg.widths[0]
    for s, (width, count) in enumerate(zip(cfg.widths, cfg.blocks)):
        for b in range(count):
            pre, stride = f"layer{s + 1}.{b}.", (2 if s > 0 and b == 0 else 1)
            out = relu(batch_norm(cfg, conv2d(x, p[pre + "conv1.weight"], stride), p, stats, pre + "bn1.", train, new))
            out = batch_norm(cfg, conv2d(out, p[pre + "conv2.weight"]), p, stats, pre + "bn2.", train, new)
            if stride != 1 or c_in != width:
                x = batch_norm(cfg, conv2d(x, p[pre + "downsample.0.weight"], stride, 0), p, stats,
                               pre + "downsample.1.", train, new)
            x, c_in = relu(out + x), width
    logits = x.mean(axis=(2, 3)) @ p["fc.weight"].T + p["fc.bias"]
    return logits, (new if train else dict(stats))


def loss(cfg, p, stats, images, labels, train=True):
    z = forward(cfg, p, stats, images, train)[0]
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return -logp[np.arange(len(labels)), labels].mean()


def directional_derivatives(cfg, p, stats, images, labels, directions, eps=1e-7):
    """name -> central difference of the loss along each direction; eps small, so no ReLU or max-pool kink lies
    within it (1e-5 crossed one on these inputs), the float64 rounding ~1e-9 of the loss."""
    out = {}
    for name, v in directions.items():
        plus, minus = dict(p), dict(p)
        plus[name], minus[name] = p[name] + eps * v, p[name] - eps * v
        out[name] = (loss(cfg, plus, stats, images, labels) - loss(cfg, minus, stats, images, labels)) / (2 * eps)
    return out
