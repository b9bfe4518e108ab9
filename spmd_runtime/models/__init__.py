"""Models written as traced functions."""
from .lm import LMConfig, init_params, lm_logits, lm_loss, lm_loss_and_metrics, param_shapes
from .moe import MoEConfig, moe_ffn, top2_gating
from .transformer import BlockConfig, block_params, megatron_specs, transformer_block

__all__ = ["BlockConfig", "block_params", "megatron_specs", "transformer_block", "LMConfig", "init_params",
           "lm_loss", "lm_loss_and_metrics", "lm_logits", "param_shapes", "MoEConfig", "moe_ffn", "top2_gating"]
