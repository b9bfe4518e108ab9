"""Layouts: every input's spec of the traced training step (parameters, optimizer state, batch) and the
activation annotations, derived from a preset. A parameter's spec follows from its sharding role, which the
model declares (``models.lm.param_roles``): the preset's axes go on the dims that role splits."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .. import pytree
from ..mesh import Mesh
from ..models.lm import LMConfig, layer_key, param_role, param_roles, param_shapes
from ..models.roles import ParamRole
from ..optim import Optimizer
from ..sharding import parse_spec
from ..trace import mesh_split
from .presets import Preset, as_preset, check_experts


def param_spec(role: ParamRole | str, shape, preset: Preset) -> tuple:
    """Megatron splits a weight's head / hidden / vocab dim (its role's tensor dim) over the model axes, the
    pipeline the layer dim of stacked layers over the stage axes, expert weights their expert dim over the
    expert axes; all else is replicated. ``role``: the parameter's sharding role, or an LM parameter's name
    (its ``models.lm.param_role``). ``shape``: the declared one; the spec is of its ``role.held_shape``."""
    role = param_role(role) if isinstance(role, str) else role
    return role.spec(len(role.held_shape(shape)), tensor=preset.model, layers=preset.stage, experts=preset.experts)


def update_spec(shape, spec, axes, mesh: Mesh, first_dim: int = 0) -> tuple:
    """``spec`` further split over ``axes`` (minor to what already splits it, so each rank's update block
    lies inside its parameter block) on the first dim from ``first_dim`` on whose local size divides evenly:
    the outermost, so each rank's update block is contiguous in its (row-major) parameter block and the
    gradient's reduce-scatter and the weight's all-gather move it with no packing on either side; ``spec``
    itself when there are no axes or no dim divides."""
    if not axes:
        return tuple(spec)
    have = [() if e is None else tuple(e) if isinstance(e, tuple) else (e,) for e in spec]
    k = mesh.axis_size(axes)
    fits = [d for d, (n, h) in enumerate(zip(shape, have)) if n % (mesh.axis_size(h) * k) == 0 and d >= first_dim]
    if not fits:
        return tuple(spec)
    dim = fits[0]
    return tuple(tuple(h) + tuple(axes) if d == dim else (tuple(h) or None) for d, h in enumerate(have))


def _used_as_held(role: ParamRole, use: tuple, update: tuple) -> bool:
    """FSDP uses a ``vocab_parallel`` role's weight in its update (held) split when that split is on the role's
    tensor dim (its vocab): what it meets is gathered instead of the weight."""
    dim = None if role.tensor is None else role.tensor + int(role.stacked)
    return role.vocab_parallel and dim is not None and update[dim] != use[dim]


@dataclass(frozen=True)
class ParamLayout:
    """Per-parameter specs of a model under a preset: ``held`` between steps (the step's inputs and outputs),
    ``use`` where the model uses the weight, ``update`` of its gradient, optimizer state and update. They differ
    only where the preset shards the update (wus) or the weights themselves (fsdp: held == update). Every spec
    is of the parameter's ``held_shapes`` entry, its declared shape (``shapes``, a state dict's) but for a
    blocked role's view (``ParamRole.blocks``): ``hold`` / ``release`` go between the two."""
    held: dict
    use: dict
    update: dict
    shapes: dict
    held_shapes: dict

    def __repr__(self):
        return f"ParamLayout({len(self.held)} parameters)"

    def hold(self, arrays: dict) -> dict:
        """NumPy arrays of the declared shapes (a state dict's) as the held ones: row-major views, no copy."""
        return held_views(arrays, self.held_shapes)

    def release(self, arrays: dict) -> dict:
        """Held arrays (NumPy or DArrays, gathered) back in the declared shapes, to save as a state dict."""
        return {n: np.reshape(np.asarray(w), self.shapes[n]) for n, w in arrays.items()}


def held_views(arrays: dict, held_shapes: dict) -> dict:
    """Arrays of the declared shapes as the held ones (``ParamRole.held_shape``): row-major views, no copy. The
    one rule ``ParamLayout.hold`` and ``Model.held_params`` share."""
    return {n: np.reshape(w, held_shapes[n]) for n, w in arrays.items()}


def param_layout(shapes: dict, roles: dict, mesh: Mesh, preset: Preset) -> ParamLayout:
    """The specs of every parameter of ANY model that declares its parameters' sharding roles (``shapes`` and
    ``roles``: name -> shape, name -> ``ParamRole``; the built-in LM's ``param_roles``, ``models.gpt2``'s, a
    user's): the preset's axes on the dims each role splits (``param_spec``), the update further split over
    ``preset.update`` (``update_spec``, never on a stacked layer dim). A blocked role's parameter is held as
    its view (``ParamRole.held_shape``; ``ParamLayout.hold`` makes it of a state dict's array)."""
    missing = [n for n in shapes if n not in roles]
    if missing:
        raise ValueError(f"param_layout needs a sharding role for every parameter; got none for {missing[:3]} "
                         f"(give each a models.roles.ParamRole)")
    preset = preset.on(mesh)
    held_shapes = OrderedDict((n, roles[n].held_shape(s)) for n, s in shapes.items())
    use = OrderedDict((n, param_spec(roles[n], s, preset)) for n, s in shapes.items())
    update = OrderedDict((n, update_spec(s, use[n], update_axes(roles[n], preset), mesh,
                                         first_dim=int(roles[n].stacked))) for n, s in held_shapes.items())
    if preset.shard_params:  # a vocab-parallel role split on its vocab is used as held (ParamRole.vocab_parallel)
        use = OrderedDict((n, update[n] if _used_as_held(roles[n], use[n], update[n]) else s) for n, s in use.items())
    held = OrderedDict((n, update[n] if held_as_updated(roles[n], preset) else use[n]) for n in shapes)
    return ParamLayout(held, use, update, OrderedDict((n, tuple(s)) for n, s in shapes.items()), held_shapes)


def update_axes(role: ParamRole, preset: Preset) -> tuple:
    """The axes a parameter's update is further split over: the preset's ``update`` axes, and for a parameter
    outside a pipeline's stacked layers (the embedding, the positional table, the final LayerNorm, an untied head)
    the stage axes too: it has no layer dim for them to split, so every stage would hold all of it, and its
    master weights and optimizer state (12 of its 16 bytes per parameter under mixed precision Adam) S times
    over where Megatron holds them once (on the first / last stage; eq. 2 counts them once)."""
    return preset.update + (preset.stage if _stage_sharded(role, preset) else ())


def held_as_updated(role: ParamRole, preset: Preset) -> bool:
    """Whether a parameter is held between steps in its update layout (and gathered to its use layout where
    the model runs on it, its gradient reduce-scattered back): FSDP's every weight, and a pipeline's parameters
    outside the stacked layers (``update_axes``: split over the stages; the 16-bit copy gathered once per step,
    before the pipeline loop, and the gradient reduced once after it, not per micro-batch)."""
    return preset.shard_params or _stage_sharded(role, preset)


def _stage_sharded(role: ParamRole, preset: Preset) -> bool:
    return bool(preset.stage) and not role.stacked


@dataclass
class Layout:
    """Every input's spec by leaf name (``params.wq``, ``opt_state.m.wq``, ``batch.tokens``: the names the
    traced step gives them), and the update spec of each per-parameter value."""
    mesh: Mesh
    preset: Preset
    specs: dict  # leaf name -> spec of that input (and of the output that replaces it)
    update: dict  # parameter name -> spec of its gradient, optimizer state and updated block
    use: dict  # parameter name -> spec of the weight where the model uses it (FSDP: gathered to this)
    slots: list  # the optimizer's StateSlots
    roles: dict  # parameter name -> its sharding role (the model's ``param_roles``)

    def annotate(self, x, spec):
        """``x`` pinned to ``spec`` with ``mesh_split``; on a one-device mesh there is nothing to say."""
        return mesh_split(x, self.mesh, spec) if self.mesh.size > 1 else x

    def activation(self, x, role):
        p = self.preset
        if role in MOE_ROLES:
            return self.annotate(x, moe_activation_spec(p, role, x.ndim))
        if role in ("normed", "hidden"):
            return self._tensor_parallel_region(x, role)
        model = p.model if role == "logits" else ()
        # sequence parallelism (megatron_sp): the logits are a tensor-parallel region, their vocab split over the
        # axes that split the sequence elsewhere; one value, split on different dims in different regions
        seq = tuple(a for a in p.seq if a not in model)
        stage = (p.stage or None,) if x.ndim == 4 else ()  # inside the pipeline: (stages, batch, seq, d)
        # outside it (embedding, head, loss) the stage axis splits the batch too, where it divides the rows: no
        # stage repeats that work
        batch = p.batch + p.stage if x.ndim == 3 and p.stage and \
            x.shape[0] % self.mesh.axis_size(p.batch + p.stage) == 0 else p.batch
        return self.annotate(x, stage + (batch or None, seq or None, model or None))

    def _tensor_parallel_region(self, x, role):
        """Sequence parallelism (the sequence split over axes that split the weights too: megatron_sp): inside a
        sublayer's tensor-parallel region the sequence is whole. Its LayerNorm output ('normed') is all-gathered
        before the column-parallel matmul, its cotangent reduce-scattered back into the sequence split; the input
        of its row-parallel matmul ('hidden') is split on its last dim. Other presets leave both to propagation."""
        p = self.preset
        seq = tuple(a for a in p.seq if a not in p.model)
        if seq == p.seq or self.mesh.size == 1:
            return x
        stage = (p.stage or None,) if x.ndim == 4 else ()
        if role == "hidden":
            return mesh_split(x, self.mesh, stage + (p.batch or None, seq or None, p.model or None))
        return mesh_split(x, self.mesh, stage + (p.batch or None, seq or None, None),
                          grad_spec=stage + (p.batch or None, p.seq or None, None))

    def gradient(self, name: str, g):
        """Parameter ``name``'s gradient ``g`` in its update layout; one a pipeline holds split over its stages
        (``update_axes``) first in its use layout, so the loops that accumulate it (the 1F1B loop's embedding and head
        gradients) keep that layout and its pending sum is reduced into the stage split once, after them (a loop
        carry takes the most split layout its uses ask for: without this, the update layout's, and every
        micro-batch's contribution gathered over the stages to it)."""
        if _stage_sharded(self.roles[name], self.preset):
            g = self.annotate(g, self.use[name])
        return self.annotate(g, self.update[name])

    def param_specs(self) -> dict:
        """Parameter name -> the spec of its input (FSDP: its update layout; ``used`` gathers it)."""
        return {n: self.specs[f"params.{n}"] for n in self.use}

    def used(self, params: dict) -> dict:
        """The weights laid out where the model uses them: each held in its update layout (``held_as_updated``:
        FSDP's, a pipeline's outside the stacked layers) all-gathered to its use spec; the others are held so."""
        return {n: self.annotate(p, self.use[n]) if self.gathered(n) else p for n, p in params.items()}

    def gathered(self, name: str) -> bool:
        """Whether parameter ``name`` is held in another layout than the model uses it in (``held_as_updated``)."""
        return held_as_updated(self.roles[name], self.preset) and self.specs[f"params.{name}"] != self.use[name]

    def annotate_state(self, state: dict) -> dict:
        """The new optimizer state tree, each slot pinned to its input's spec (so the step iterates)."""
        paths, tree = pytree.flatten_with_path(state)
        return tree.unflatten(self.annotate(x, self.specs[pytree.keystr(p, "opt_state")]) for p, x in paths)

    def layer_specs(self, specs: dict) -> dict:
        """Of per-parameter ``specs`` (``use`` or ``update``), those of the stacked layer parameters, keyed as the
        model keys one layer's parameters (``layer_key``: the kind, '<r>_<kind>' in a group of blocks) and without
        the leading layer dim: the specs of one layer's slice, where a loop over the layers uses it."""
        return {layer_key(n): spec[1:] for n, spec in specs.items() if self.roles[n].stacked}


MOE_ROLES = ("groups", "expert_in", "expert_hidden", "expert_out")


def moe_activation_spec(preset: Preset, role: str, ndim: int) -> tuple:
    """'groups' (G, ...): groups split like the batch; 'expert_in' (E, G, C, M) and 'expert_hidden'
    (E, G, C, H): experts on the expert axes, groups on the rest of the batch axes, H on the model axes;
    'expert_out' (E, G, C, M): back with the tokens, groups split like the batch."""
    if role == "groups":
        return (preset.batch or None,) + (None,) * (ndim - 1)
    if role == "expert_out":
        return (None, preset.batch or None) + (None,) * (ndim - 2)
    rest = tuple(a for a in preset.batch if a not in preset.experts) or None
    hidden = (preset.model or None) if role == "expert_hidden" else None
    return (preset.experts or None, rest, None, hidden)


def make_layout(cfg: LMConfig, mesh: Mesh, preset: Preset, optimizer: Optimizer) -> Layout:
    check_experts(cfg, mesh, preset)
    shapes = param_shapes(cfg)
    return model_layout(mesh, preset, shapes, param_roles(cfg), optimizer.state_layout(shapes, cfg.master_dtype))


def model_layout(mesh: Mesh, preset, shapes: dict, roles: dict, slots=()) -> Layout:
    """The layout of any model that declares its parameters' sharding roles (``models.lm.param_roles``,
    ``models.gpt2`` / ``models.llama``'s ``param_roles``) under ``preset`` (a name or a Preset): each parameter's
    specs (``param_layout``), the inputs' specs (``params.<name>``, ``batch.tokens`` / ``batch.labels``; the
    optimizer state's for ``slots``, an optimizer's ``state_layout``) and the activation annotations
    (``Layout.activation``, the ``annotate`` a model takes)."""
    preset = as_preset(preset).on(mesh)
    params = param_layout(shapes, roles, mesh, preset)
    use, update = params.use, dict(params.update)
    specs = {f"params.{n}": params.held[n] for n in shapes}
    for slot in slots:
        specs[state_leaf_name(slot)] = slot_spec(slot, update)
    specs["batch.tokens"] = specs["batch.labels"] = (preset.batch or None, preset.seq or None)
    for name, spec in specs.items():
        parse_spec(spec, mesh, len(spec), name)  # fail early, naming the value
    return Layout(mesh, preset, specs, update, use, list(slots), OrderedDict(roles))


def slot_spec(slot, update: dict) -> tuple:
    """An optimizer state slot's spec: its parameter's update spec on the dims it keeps (a factored moment
    drops one); a global scalar's is replicated."""
    if not slot.param:
        return (None,) * len(slot.shape)
    spec = update[slot.param]
    return tuple(spec) if slot.dims is None else tuple(spec[d] for d in slot.dims)


def state_leaf_name(slot) -> str:
    """The traced step's name of an optimizer state slot: its path under ``opt_state``."""
    return pytree.keystr(slot.key, "opt_state")
