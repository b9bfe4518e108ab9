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
    leading layer dim (scanned layers), so those dims come one later."""
    kind: str
    tensor: int | None = None
    experts: int | None = None
    stacked: bool = False

    def stack(self) -> "ParamRole":
        """This role for the parameter of every layer stacked on a leading layer dim."""
        return dataclasses.replace(self, stacked=True)

    def spec(self, ndim: int, tensor=None, experts=None, layers=None) -> tuple:
        """The spec of an ``ndim``-d parameter in this role: ``tensor`` on its tensor dim, ``layers`` on its
        layer dim, ``experts`` on its expert dim (mesh axes; a falsy one leaves its dim alone); every other
        dim replicated."""
        spec = [None] * ndim
        lead = int(self.stacked)
        if tensor and self.tensor is not None:
            spec[self.tensor + lead] = tensor  # stacked layers: after the layer dim
        if layers and self.stacked:
            spec[0] = layers  # pipeline: rank j holds the layers of stage j
        if experts and self.experts is not None:
            spec[self.experts + lead] = experts
        return tuple(spec)


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
