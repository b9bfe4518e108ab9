"""GShard mixture-of-experts feed-forward layer (Lepikhin et al. 2020) as ordinary traced code.

Tokens come in as G groups of S tokens (the group dim split like the batch). Per group:

- gate logits ``GSM,ME->GSE``, softmax in float32;
- top-1 expert = argmax, top-2 = argmax of the probabilities with the top-1 masked out (GShard's
  reference code; ``snp.top_k`` is used instead when the op exists);
- capacity ``C = ceil(capacity_factor * k * S / E)``: a token's position in its expert's buffer is a
  cumulative sum over the group (second choices queue behind every first choice); tokens at position
  >= C are dropped (combine weight 0) and counted;
- the kept top-2 gates renormalised to sum to 1 (GShard's non-legacy behaviour); policy "random"
  dispatches the second expert only with probability min(1, g2 / threshold), g2 the normalised second
  gate (GShard Algorithm 1: threshold 0.5, i.e. ``2 * g2 > uniform``);
- auxiliary load-balancing loss ``E^2 * mean_{g,e}(f_ge * p_ge)`` = E * sum_e f_e p_e per group (f: fraction
  of the group's tokens whose top-1 is e, p: their mean gate probability of e), 1 at perfect balance.

Then dispatch ``GSEC,GSM->EGCM`` (one-hot mask), the expert FFN ``EGCM,EMH->EGCH`` / ``EGCH,EHM->EGCM``
and combine ``GSEC,EGCM->GSM``. Parallelism is annotations only (``annotate(x, role)``): the roles
'groups' (G,S,M), 'expert_in' (E,G,C,M), 'expert_hidden' (E,G,C,H) and 'expert_out' (E,G,C,M back in the
tokens' layout, before the combine). With the group dim split over the expert axis and E split over it, the
partitioner emits one all-to-all into the experts and one back (plus the same two in the backward pass); no
collective is written here. Both results are named (``ALL_TO_ALL_NAMES``, ``checkpoint_name``): under
``LMConfig(remat="full_save_all_to_all")`` they are saved, and the recomputed forward sends nothing. 'groups'
also pins the (G,S,E,C) combine and dispatch tensors (any rank: the group dim first), so their cotangents stay
with the tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import numpy as snp
from ..nn import gelu
from ..ops.control import checkpoint_name
from .roles import ParamRole

SECOND_POLICIES = ("all", "random")
ALL_TO_ALL_NAMES = ("moe_expert_in", "moe_expert_out")  # the checkpoint names of the all-to-alls' results
GATE_DTYPE = "float32"

# Sharding hints: the roles of ``moe_ffn``'s weights (its argument names), so a trainer splits them by role
ROUTER = ParamRole("router")  # gate (M, E): replicated
EXPERT_COLUMN = ParamRole("expert column-parallel weight", tensor=2, experts=0)  # w1 (E, M, H): experts, hidden
EXPERT_ROW = ParamRole("expert row-parallel weight", tensor=1, experts=0)  # w2 (E, H, M): experts, hidden
PARAM_ROLES = {"wg": ROUTER, "w1": EXPERT_COLUMN, "w2": EXPERT_ROW}


@dataclass(frozen=True)
class MoEConfig:
    """The gating and expert shape of one MoE layer."""
    experts: int
    top_k: int = 2
    capacity_factor: float = 2.0
    second_policy: str = "all"  # "all" or "random"
    second_threshold: float = 0.5

    def __post_init__(self):
        check_moe(self.experts, self.top_k, self.capacity_factor, self.second_policy, self.second_threshold)

    def capacity(self, group_size: int) -> int:
        """Expert buffer slots per group: ceil(capacity_factor * k * S / E)."""
        return max(1, math.ceil(self.capacity_factor * self.top_k * group_size / self.experts))


def check_moe(experts, top_k, capacity_factor, second_policy="all", second_threshold=0.5) -> None:
    """The MoE settings' rules, checked before anything is traced (so every rank raises alike)."""
    if experts < 2:
        raise ValueError(f"a mixture of experts needs experts >= 2; got experts={experts} "
                         f"(use a dense LMConfig for one expert)")
    if top_k > experts:
        raise ValueError(f"MoE top_k must be <= experts; got top_k={top_k}, experts={experts}")
    if top_k not in (1, 2):
        raise ValueError(f"MoE top_k must be 1 or 2 (GShard top-2 gating, or Switch top-1); got top_k={top_k}")
    if not capacity_factor > 0:
        raise ValueError(f"MoE capacity_factor must be > 0; got capacity_factor={capacity_factor}")
    if second_policy not in SECOND_POLICIES:
        raise ValueError(f"MoE second_policy must be one of {SECOND_POLICIES}; got {second_policy!r}")
    if not second_threshold > 0:
        raise ValueError(f"MoE second_threshold must be > 0; got {second_threshold}")


@dataclass
class Gating:
    """Traced results of top-k gating for (G, S) tokens and E experts with capacity C."""
    combine: object   # (G,S,E,C) float32: gate weight of the token in that expert slot, 0 elsewhere
    dispatch: object  # (G,S,E,C) float32 one-hot: the token sits in that slot
    aux_loss: object  # () float32
    dropped: object   # () float32: routed assignments that found their expert full
    routed: object    # () float32: routed assignments (G*S*k, fewer under random routing)


def no_annotation(x, role):
    return x


def top2_gating(logits, cfg: MoEConfig, noise=None) -> Gating:
    """GShard top-k gating of (G, S, E) ``logits``; ``noise`` (G, S) uniform in [0, 1) drives random routing."""
    g, s, e = logits.shape
    if cfg.top_k == 2 and cfg.second_policy == "random" and (noise is None or tuple(noise.shape) != (g, s)):
        raise ValueError(f"random routing of the second expert needs uniform noise of shape (G, S) = {(g, s)}; "
                         f"got {None if noise is None else tuple(noise.shape)}")
    capacity = cfg.capacity(s)
    probs = snp.softmax(snp.astype(logits, GATE_DTYPE), axis=-1)
    index1, index2 = _top_indices(probs, cfg.top_k)
    mask1 = one_hot(index1, e)
    gate1 = snp.sum(probs * mask1, axis=-1)
    aux = snp.mean(snp.mean(mask1, axis=1) * snp.mean(probs, axis=1)) * float(e * e)

    pos1 = _exclusive_cumsum(mask1)
    kept1 = mask1 * snp.astype(pos1 < capacity, GATE_DTYPE)
    routed, kept = snp.sum(mask1), snp.sum(kept1)
    choices = [(kept1, _position(pos1, kept1), gate1 * snp.sum(kept1, axis=-1))]  # top-1 (Switch): unnormalised
    if cfg.top_k == 2:
        mask2 = one_hot(index2, e)
        gate2 = snp.sum(probs * mask2, axis=-1)
        if cfg.second_policy == "random":
            share = gate2 / _nonzero(gate1 + gate2)
            mask2 = mask2 * snp.expand_dims(snp.astype(noise < share * (1.0 / cfg.second_threshold), GATE_DTYPE), -1)
        pos2 = _exclusive_cumsum(mask2) + snp.expand_dims(snp.sum(kept1, axis=1), 1)  # behind every first choice
        kept2 = mask2 * snp.astype(pos2 < capacity, GATE_DTYPE)
        routed, kept = routed + snp.sum(mask2), kept + snp.sum(kept2)
        gate1, gate2 = choices[0][2], gate2 * snp.sum(kept2, axis=-1)
        denom = _nonzero(gate1 + gate2)
        choices = [(kept1, choices[0][1], gate1 / denom), (kept2, _position(pos2, kept2), gate2 / denom)]
    combine = dispatch = None
    for kept_mask, position, gate in choices:
        where = snp.expand_dims(kept_mask, -1) * snp.expand_dims(one_hot(position, capacity), 2)  # GSEC
        weighted = where * snp.expand_dims(snp.expand_dims(gate, -1), -1)
        combine = weighted if combine is None else combine + weighted
        dispatch = where if dispatch is None else dispatch + where
    return Gating(combine, dispatch, aux, routed - kept, routed)


def _top_indices(probs, k: int):
    """Top-1 (``argmax``) or, k == 2, top-2 (``snp.top_k``) expert per token (``moe_ffn`` checks k is 1 or 2)."""
    if k == 2:
        _, index = snp.top_k(probs, 2)
        return index[..., 0], index[..., 1]
    return snp.argmax(probs, axis=-1), None


def _exclusive_cumsum(mask):
    """Per (group, expert): how many earlier tokens of the group chose that expert."""
    return snp.cumsum(mask, axis=1) - mask


def _position(pos, kept):
    """(G, S) buffer slot of each kept token (0 for dropped ones, whose mask is 0 anyway)."""
    return snp.sum(pos * kept, axis=-1)


def _nonzero(x):
    return snp.where(x > 0.0, x, 1.0)


def one_hot(ids, n: int, dtype=GATE_DTYPE):
    """(..., n): 1 where the last index equals ``ids`` (int or integral float)."""
    return snp.astype(snp.expand_dims(ids, -1) == snp.asarray(np.arange(n, dtype=ids.dtype)), dtype)


def moe_ffn(x, wg, w1, w2, cfg: MoEConfig, annotate=no_annotation, noise=None):
    """The MoE feed-forward of grouped tokens ``x`` (G, S, M): gate ``wg`` (M, E), experts ``w1`` (E, M, H),
    ``w2`` (E, H, M). Returns (y (G, S, M), Gating)."""
    if wg.shape[-1] != cfg.experts or w1.shape[0] != cfg.experts or w2.shape[0] != cfg.experts:
        raise ValueError(f"MoE weights must have {cfg.experts} experts; got wg {wg.shape}, w1 {w1.shape}, "
                         f"w2 {w2.shape}")
    x = annotate(x, "groups")
    gating = top2_gating(snp.einsum("GSM,ME->GSE", x, wg), cfg, noise)
    # pinned to the token layout, so their cotangents (through the combine einsum's VJP) stay there too
    combine, dispatch = (annotate(snp.astype(t, x.dtype), "groups") for t in (gating.combine, gating.dispatch))
    # each all-to-all's result named (ALL_TO_ALL_NAMES): a remat policy that saves them recomputes the experts
    # from the saved input, and the combine's VJP reads the saved output, so no all-to-all is sent again
    expert_in = checkpoint_name(annotate(snp.einsum("GSEC,GSM->EGCM", dispatch, x), "expert_in"), "moe_expert_in")
    hidden = annotate(gelu(snp.einsum("EGCM,EMH->EGCH", expert_in, w1)), "expert_hidden")
    expert_out = annotate(snp.einsum("EGCH,EHM->EGCM", hidden, w2), "expert_in")
    back = checkpoint_name(annotate(expert_out, "expert_out"), "moe_expert_out")  # in the tokens' layout
    return annotate(snp.einsum("GSEC,EGCM->GSM", combine, back), "groups"), gating


__all__ = ["MoEConfig", "Gating", "check_moe", "top2_gating", "moe_ffn", "one_hot", "SECOND_POLICIES",
           "ALL_TO_ALL_NAMES",
           "PARAM_ROLES"]
