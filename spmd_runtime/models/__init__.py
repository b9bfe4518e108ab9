"""Models written as traced functions."""
from .lm import LMConfig, init_params, lm_logits, lm_loss, param_shapes
from .transformer import BlockConfig, block_params, megatron_specs, transformer_block

__all__ = ["BlockConfig", "block_params", "megatron_specs", "transformer_block", "LMConfig", "init_params",
           "lm_loss", "lm_logits", "param_shapes"]
