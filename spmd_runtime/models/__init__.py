"""Models written as traced functions, each declaring its parameters' sharding roles (``roles``)."""
from .lm import LMConfig, init_params, lm_logits, lm_loss, lm_loss_and_metrics, param_roles, param_shapes
from .moe import MoEConfig, moe_ffn, top2_gating
from .roles import ParamRole
from .transformer import BlockConfig, block_params, megatron_specs, transformer_block
from . import gpt2, llama, resnet  # the model zoo on the public API: nanoGPT's GPT-2, llama2.c's Llama 2, a ResNet

__all__ = ["BlockConfig", "block_params", "megatron_specs", "transformer_block", "LMConfig", "init_params",
           "lm_loss", "lm_loss_and_metrics", "lm_logits", "param_shapes", "param_roles", "ParamRole", "MoEConfig",
           "moe_ffn", "top2_gating"]
__all__ += ["gpt2", "llama", "resnet"]
