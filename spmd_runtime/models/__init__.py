"""Models written as traced functions."""
from .transformer import BlockConfig, block_params, megatron_specs, transformer_block

__all__ = ["BlockConfig", "block_params", "megatron_specs", "transformer_block"]
