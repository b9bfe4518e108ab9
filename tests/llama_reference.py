"""A NumPy Llama (llama2.c's model.py Transformer) written independently of ``spmd_runtime.models.llama``, for
its tests: logits and loss of the same parameter dict (llama2.c's names, [out, in] Linear weights), and the
directional finite differences of the loss that check every gradient."""
import numpy as np

THETA = 10000.0


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, positions):
    """Rotate each (even, odd) pair of the head dim of x (b, s, h, hd) by position * THETA^(-2i / hd)."""
    hd = x.shape[-1]
    angle = np.outer(positions, THETA ** (-np.arange(0, hd, 2) / hd))[None, :, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * np.cos(angle) - odd * np.sin(angle)
    out[..., 1::2] = even * np.sin(angle) + odd * np.cos(angle)
    return out


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def silu(x):
    return x / (1 + np.exp(-x))


def no_dropout(x):
    return x


def logits(cfg, p, tokens, dropout=no_dropout):
    """(b, s, vocab) logits; ``dropout(x)`` applied at llama2.c's sites in its order (embedding; per layer the
    attention probabilities, the attention output, the FFN output)."""
    b, s = tokens.shape
    heads, kv, eps = cfg.n_heads, cfg.n_kv_heads or cfg.n_heads, cfg.norm_eps
    hd = cfg.dim // heads
    h = dropout(p["tok_embeddings.weight"][tokens])
    causal = np.tril(np.ones((s, s), bool))
    for i in range(cfg.n_layers):
        w = {k[len(f"layers.{i}."):]: v for k, v in p.items() if k.startswith(f"layers.{i}.")}
        a = rms_norm(h, w["attention_norm.weight"], eps)
        q = rope((a @ w["attention.wq.weight"].T).reshape(b, s, heads, hd), np.arange(s))
        k = rope((a @ w["attention.wk.weight"].T).reshape(b, s, kv, hd), np.arange(s))
        v = (a @ w["attention.wv.weight"].T).reshape(b, s, kv, hd)
        k, v = np.repeat(k, heads // kv, axis=2), np.repeat(v, heads // kv, axis=2)  # query head j uses kv j // rep
        scores = np.where(causal, np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd), -np.inf)
        ctx = np.einsum("bhqk,bkhd->bqhd", dropout(softmax(scores)), v).reshape(b, s, cfg.dim)
        h = h + dropout(ctx @ w["attention.wo.weight"].T)
        a = rms_norm(h, w["ffn_norm.weight"], eps)
        hidden = silu(a @ w["feed_forward.w1.weight"].T) * (a @ w["feed_forward.w3.weight"].T)
        h = h + dropout(hidden @ w["feed_forward.w2.weight"].T)
    h = rms_norm(h, p["norm.weight"], eps)
    head = p["tok_embeddings.weight"] if cfg.tie_embeddings else p["output.weight"]
    return h @ head.T


def cross_entropy(z, targets):
    """Mean of -log softmax(z)[target] over the targets that are not -1."""
    z = z.reshape(-1, z.shape[-1])
    t = targets.reshape(-1)
    logp = z - z.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    keep = t != -1
    return -logp[np.arange(len(t)), np.where(keep, t, 0)][keep].mean()


def loss(cfg, p, tokens, targets, dropout=no_dropout):
    return cross_entropy(logits(cfg, p, tokens, dropout), targets)


def directional_derivatives(cfg, p, tokens, targets, directions, eps=1e-5, dropout_masks=None):
    """name -> (L(p + eps v) - L(p - eps v)) / 2 eps for each parameter's direction v (float64; the dropout
    masks, a list in site order, held fixed)."""
    def f(q):
        masks = iter(dropout_masks or [])
        return loss(cfg, q, tokens, targets, (lambda x: x * next(masks)) if dropout_masks else no_dropout)
    out = {}
    for name, v in directions.items():
        plus, minus = dict(p), dict(p)
        plus[name], minus[name] = p[name] + eps * v, p[name] - eps * v
        out[name] = (f(plus) - f(minus)) / (2 * eps)
    return out
