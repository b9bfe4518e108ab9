"""Sharding hints a model declares for its parameters: each parameter's role and the dims that role lets a
sharding split.

The models name their parameters' roles (``lm.PARAM_ROLES``, ``moe.PARAM_ROLES``, ``transformer.PARAM_ROLES``);
a trainer's presets map roles to mesh axes and never name a parameter: tensor (Megatron) parallelism splits
every role's ``tensor`` dim (attention heads, MLP hidden, vocab), expert parallelism its ``experts`` dim,
pipeline stages the leading layer dim of stacked (scanned) parameters. This module holds the role type and
the roles the models share.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class ParamRole:
    """What a parameter is (``kind``: "column-parallel weight", "embedding", ...) and which of its dims a
    sharding may split: ``tensor`` the dim tensor parallelism splits, ``experts`` the expert dim (None: no
    such dim), both counted in ONE layer's parameter. ``stacked``: the parameter holds every layer's on a
    leading layer dim (scanned layers), so those dims come one later. ``blocks`` > 1: the tensor dim is that
    many equal blocks side by side (q, k and v fused in one weight), each split on its own; the parameter is
    then held as the row-major view with that dim n as (blocks, n / blocks) (``held_shape``: the same bytes,
    a free reshape), whose second dim tensor parallelism splits, so each rank holds its heads of every block
    (a contiguous split of the fused dim would not line up with them). ``vocab_parallel``: FSDP uses the weight
    in its held split when that split is of the tensor dim (a tied embedding: the lookup and the head's logits
    run vocab-parallel, the (b, t, d) activations they meet gathered over the batch instead of the (vocab, d)
    table, and its gradient is made in its held block, not whole and reduce-scattered)."""
    kind: str
    tensor: int | None = None
    experts: int | None = None
    stacked: bool = False
    blocks: int = 1
    vocab_parallel: bool = False

    def __post_init__(self):
        if not isinstance(self.blocks, int) or self.blocks < 1 or (self.blocks > 1 and self.tensor is None):
            raise ValueError(f"ParamRole blocks is an int >= 1 and needs a tensor dim when > 1; got "
                             f"blocks={self.blocks!r}, tensor={self.tensor!r}")

    def held_shape(self, shape) -> tuple:
        """The shape a parameter of declared ``shape`` is held in: ``shape`` itself, or with the blocked tensor
        dim n viewed as (blocks, n / blocks)."""
        shape = tuple(shape)
        if self.blocks == 1:
            return shape
        dim = self.tensor + int(self.stacked)
        if shape[dim] % self.blocks:
            raise ValueError(f"a {self.kind} holds {self.blocks} equal blocks on dim {dim}; got shape {shape}")
        return shape[:dim] + (self.blocks, shape[dim] // self.blocks) + shape[dim + 1:]

    def stack(self) -> "ParamRole":
        """This role for the parameter of every layer stacked on a leading layer dim."""
        return dataclasses.replace(self, stacked=True)

    def spec(self, ndim: int, tensor=None, experts=None, layers=None) -> tuple:
        """The spec of an ``ndim``-d parameter in this role (``ndim`` of its ``held_shape``): ``tensor`` on its
        tensor dim (of a blocked one, on the dim within the blocks), ``layers`` on its layer dim, ``experts`` on
        its expert dim (mesh axes; a falsy one leaves its dim alone); every other dim replicated."""
        spec = [None] * ndim
        if tensor and self.tensor is not None:
            spec[self._held_dim(self.tensor)] = tensor
        if layers and self.stacked:
            spec[0] = layers  # pipeline: rank j holds the layers of stage j
        if experts and self.experts is not None:
            spec[self._held_dim(self.experts)] = experts
        return tuple(spec)

    def _held_dim(self, dim: int) -> int:
        """Where one layer's dim ``dim`` lies in the held parameter: after the layer dim of stacked layers, and one
        later from a blocked tensor dim on (its block dim comes first)."""
        return dim + int(self.stacked) + int(self.blocks > 1 and dim >= self.tensor)


COLUMN = ParamRole("column-parallel weight", tensor=1)  # (d_in, d_out): the output columns (heads, MLP hidden)
ROW = ParamRole("row-parallel weight", tensor=0)  # (d_in, d_out): the input rows; the partial sums all-reduced
NORM = ParamRole("norm")  # LayerNorm gain or bias: replicated
COLUMN_BIAS = ParamRole("column-parallel bias", tensor=0)  # (d_out,): split like its weight's columns
ROW_BIAS = ParamRole("row-parallel bias")  # (d_out,): added after the partial sums are reduced: replicated
# PyTorch's nn.Linear keeps its weight as [out, in]: tensor parallelism splits the out dim of a column-parallel
# layer (heads, MLP hidden) and the in dim of a row-parallel one (its partial sums are then all-reduced)
LINEAR_COLUMN = ParamRole("column-parallel Linear [out, in]", tensor=0)
LINEAR_ROW = ParamRole("row-parallel Linear [out, in]", tensor=1)

__all__ = ["ParamRole", "COLUMN", "ROW", "NORM", "COLUMN_BIAS", "ROW_BIAS", "LINEAR_COLUMN", "LINEAR_ROW"]
