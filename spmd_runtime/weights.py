"""PyTorch-layout state dicts in and out: ``.safetensors`` files <-> this rank's blocks of sharded arrays.

``load_safetensors`` reads a state dict saved by PyTorch (``safetensors.torch.save_file``, Hugging Face's
``save_pretrained``) into the blocks the checkpoint API hands out (name -> this rank's TRUE block, or
``DArray``s with ``darrays=True``). EACH RANK READS ONLY ITS OWN BLOCKS: per tensor it asks the file for the
slices its block covers (``safe_open(path, framework="numpy").get_slice(name)[slices]``, the slices from
the layout rule, ``checkpoint.local_block_slices``); nothing else is read and nothing crosses the wire but
the ranks' agreement on errors.

``save_safetensors`` writes sharded arrays to ONE file that ``safetensors.torch.load_file`` (and so
``model.load_state_dict``) reads. How blocks reach the file: they do not travel. Every rank computes the
same header (names, dtypes, shapes, offsets; agreed on first), rank 0 writes it and sizes the file, then
each block's writer (the replica with coordinate 0 on the axes that do not split the tensor, as for
checkpoints) writes its block's rows straight into the file at their byte offsets (``os.pwrite``: one call
per contiguous run, so a row-split block is one call and a column-split matrix one per row). No array is
pickled or sent; the file must lie on a filesystem every rank sees (as a checkpoint directory must). Copies
of a replicated block must be bit-identical (crc32s compared, as ``save_checkpoint`` does). The file is
written as ``<path>.tmp-<id>`` and renamed into place once every rank has written: a failed or killed save
leaves the previous file.

Names and layouts: ``names`` maps our names to the file's (default: the same); ``transforms`` maps our names
to a ``Transpose`` where our layout is the file's transposed (e.g. a ``[in, out]`` weight of ours against
``nn.Linear``'s ``[out, in]``): each rank still reads only its block, the transposed slices. ``tied`` maps
a file name to the file name it is tied to (nanoGPT: ``{"lm_head.weight": "transformer.wte.weight"}``).
As Hugging Face does (``_tied_weights_keys``; safetensors refuses tensors that share memory), only the
source is stored: a save drops the alias (its blocks must equal the source's, checked per rank), a load
reads an alias the file lacks from its source. The file's ``__metadata__`` records the ties
(``spmd_runtime.tied``; a load given no ``tied`` uses them); PyTorch then loads with ``strict=False`` and re-ties (nanoGPT's
``GPT`` keeps the tie itself: loading ``transformer.wte.weight`` sets ``lm_head.weight``).

Checks, on every rank, raising ``WeightsError`` on EVERY rank (``comm.agreement``): with ``expect`` (our
name -> (global shape, dtype)) or a program, a tensor missing from the file, one in the file the model
lacks (``strict=False`` skips it), a wrong shape or dtype (no silent cast), each named with its file name.

Conversions: ``safetensors_to_checkpoint`` / ``checkpoint_to_safetensors`` go between a file and the
project's sharded checkpoints (``save_checkpoint``, ``TrainStep.save`` / ``TrainStep.load``, whose tensors
are named ``params.<name>``: map those names to the file's with ``names``).
"""
from __future__ import annotations

import json
import math
import os
import uuid
from dataclasses import dataclass
from itertools import product
from pathlib import Path

import numpy as np

try:  # optional (pip install spmd_runtime[weights]): the reader; the writer below needs nothing
    from safetensors import safe_open
except ImportError:
    safe_open = None

from . import pytree
from .checkpoint import (CheckpointError, _check_replicas, _crc, _is_writer, _load_specs, _resolve_sharding,
                         _save_entries, _true_block, _world, checkpoint_info, load_checkpoint, local_block_slices,
                         save_checkpoint)
from .comm.agreement import AgreedError, agree, capture
from .darray import DArray
from .dtypes import BFLOAT16
from .mesh import Mesh
from .program import SPMDProgram
from .sharding import Sharding

TIED_KEY = "spmd_runtime.tied"  # the __metadata__ entry recording the ties (a JSON object alias -> source)

# safetensors' dtype codes (the format's spec) for the dtypes a sharded array may have, in the order its own
# writer lays tensors out (its dtype enum, largest first: every tensor stays aligned to its item size)
_CODES = {"uint64": "U64", "int64": "I64", "float64": "F64", "complex64": "C64", "float32": "F32", "uint32": "U32",
          "int32": "I32", "bfloat16": "BF16", "float16": "F16", "uint16": "U16", "int16": "I16", "int8": "I8",
          "uint8": "U8", "bool": "BOOL"}
if BFLOAT16 is None:
    del _CODES["bfloat16"]
_DTYPES = {code: np.dtype(name) for name, code in _CODES.items()}
_ORDER = {name: i for i, name in enumerate(_CODES)}


class WeightsError(AgreedError):
    """A safetensors load or save failed on some rank; raised on every rank."""


@dataclass(frozen=True)
class Transpose:
    """Our tensor is the file's transposed: ``ours = np.transpose(stored, axes)`` (``axes`` None: reversed)."""
    axes: tuple | None = None

    def _axes(self, ndim: int) -> tuple:
        axes = tuple(range(ndim))[::-1] if self.axes is None else tuple(self.axes)
        if sorted(axes) != list(range(ndim)):
            raise ValueError(f"Transpose axes must be a permutation of the tensor's {ndim} dims; got {axes}")
        return axes

    def stored_shape(self, shape) -> tuple:
        """The file's shape of a tensor of ours with ``shape`` (the same rule for slices)."""
        axes, shape = self._axes(len(shape)), tuple(shape)
        stored = [None] * len(shape)
        for ours, theirs in enumerate(axes):
            stored[theirs] = shape[ours]
        return tuple(stored)

    stored_slices = stored_shape

    def to_ours(self, block: np.ndarray) -> np.ndarray:
        return _c_order(np.transpose(block, self._axes(block.ndim)))

    def to_stored(self, block: np.ndarray) -> np.ndarray:
        return _c_order(np.transpose(block, np.argsort(self._axes(block.ndim))))


def _c_order(x: np.ndarray) -> np.ndarray:
    """``x`` in C order (np.ascontiguousarray would make a scalar 1-d)."""
    return np.require(x, requirements="C")


class _Same:
    """The identity layout (a tensor without a transform)."""
    stored_shape = stored_slices = staticmethod(tuple)
    to_ours = to_stored = staticmethod(_c_order)


def _transform(transforms, name: str):
    t = (transforms or {}).get(name)
    if t is None:
        return _Same
    if not isinstance(t, Transpose):
        raise TypeError(f"a transform must be a Transpose; got {t!r} for {name!r}")
    return t


def _need_reader() -> None:
    if safe_open is None:
        raise ImportError("load_safetensors needs the safetensors package; install it with "
                          "`pip install spmd_runtime[weights]` (or `pip install safetensors`)")


# ------------------------------------------------------------------ load

def load_safetensors(path, mesh: Mesh, shardings=None, *, names=None, transforms=None, tied=None, expect=None,
                     strict: bool = True, like=None, darrays: bool = False, comm=None):
    """Collectively load a ``.safetensors`` state dict: our name -> this rank's TRUE block (see the module doc).

    ``shardings``: our name -> Sharding or mesh_split spec on ``mesh`` (tensors not named come back
    replicated), or an SPMDProgram (its inputs/outputs by name). ``names``: our name -> the file's name.
    ``transforms``: our name -> ``Transpose``. ``tied``: file alias -> file source (default: the ties the file
    records, if any). ``expect``: our name ->
    (global shape, dtype) the model needs (a program's inputs/outputs are expected too): then exactly those
    tensors load, and any that is missing, unexpected (unless ``strict=False``), or of another shape or dtype
    fails the load on every rank, naming each; without it every tensor of the file loads. ``like``: a pytree
    whose dotted leaf paths are our names (the result has its structure); ``darrays``: DArrays instead of
    blocks. Each rank reads only the slices of the file its blocks cover.
    """
    comm = _world(comm, mesh)
    loaded, error = capture(_load_local, path, mesh, shardings, comm.Get_rank(), names, transforms, tied, expect,
                            strict)
    if error is None and like is not None:
        error = _like_error(loaded, like)
    agree(comm, error, "load_safetensors", error_type=WeightsError)
    out = {n: DArray(b, shape, b.dtype, mesh, sh, comm) if darrays else b for n, (b, shape, sh) in loaded.items()}
    if like is None:
        return out
    paths, tree = pytree.flatten_with_path(like)
    return tree.unflatten(out[pytree.keystr(p)] for p, _ in paths)


def _like_error(loaded: dict, like) -> str | None:
    missing = [n for n in pytree.leaf_names(like) if n not in loaded]
    if missing:
        return f"KeyError: like= names tensors the file holds; got {missing} not among {sorted(loaded)}"
    return None


def _load_local(path, mesh: Mesh, shardings, rank: int, names, transforms, tied, expect, strict: bool) -> dict:
    _need_reader()
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"load_safetensors needs an existing .safetensors file; got no file {path}")
    with safe_open(str(path), framework="numpy") as f:
        stored = {k: _shape_and_code(f.get_slice(k)) for k in f.keys()}
        wanted = _wanted(shardings, expect)
        tied = dict(tied) if tied is not None else _recorded_ties(f.metadata(), path)
        sources = _sources(stored, names or {}, tied, wanted, strict, path, transforms)
        specs = _load_specs(shardings, mesh, sources)
        unknown = sorted(set(specs) - set(sources))
        if unknown:
            raise KeyError(f"load_safetensors shardings must name tensors it loads {sorted(sources)}; got unknown "
                           f"name(s) {unknown}")
        out = {}
        for ours, (key, shape, dtype) in sources.items():
            sharding = _resolve_sharding(specs.get(ours, Sharding.replicated(len(shape))), shape, mesh, ours)
            block = _read_block(f, key, local_block_slices(shape, sharding, mesh, rank), dtype,
                                _transform(transforms, ours))
            out[ours] = (block, shape, sharding)
    return out


def _recorded_ties(metadata, path: Path) -> dict:
    """The ties a file records (``save_safetensors`` writes them), used when the caller names none."""
    try:
        ties = json.loads((metadata or {}).get(TIED_KEY, "{}"))
    except ValueError:
        ties = None
    if not (isinstance(ties, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in ties.items())):
        raise ValueError(f"the {TIED_KEY!r} metadata of a .safetensors file maps alias names to source names (a "
                         f"JSON object of strings); got {(metadata or {}).get(TIED_KEY)!r} in {path} (pass tied= "
                         f"to override it)")
    return ties


def _shape_and_code(view) -> tuple:
    return tuple(view.get_shape()), view.get_dtype()


def _read_block(f, key: str, slices: tuple, dtype, transform) -> np.ndarray:
    """This rank's block: the file's slices it covers (transposed back where the layouts differ)."""
    if any(s.stop <= s.start for s in slices):  # an empty trailing block: nothing to read
        return np.empty([max(0, s.stop - s.start) for s in slices], dtype)
    return transform.to_ours(f.get_slice(key)[transform.stored_slices(slices)])


def _wanted(shardings, expect) -> dict | None:
    """Our name -> (shape, dtype) the caller needs (``expect`` and a program's inputs/outputs), or None."""
    if expect is None and not isinstance(shardings, SPMDProgram):
        return None
    wanted = {}
    if isinstance(shardings, SPMDProgram):
        wanted = {io.name: (tuple(io.shape), np.dtype(io.dtype)) for io in shardings.inputs + shardings.outputs}
    for name, (shape, dtype) in (expect or {}).items():
        wanted[name] = (tuple(int(n) for n in shape), np.dtype(dtype))
    return wanted


def _sources(stored: dict, names: dict, tied: dict, wanted, strict: bool, path: Path, transforms) -> dict:
    """Our name -> (file key, our global shape, dtype) of each tensor to load; with ``wanted``, raise naming
    every tensor that does not fit it (unless ``strict=False``, which keeps only those that do)."""
    key_of = lambda ours: names.get(ours, ours)  # noqa: E731
    ours_of = {theirs: ours for ours, theirs in names.items()}
    problems, out = [], {}
    if wanted is None:  # every stored tensor, under our name
        wanted = {ours_of.get(k, k): None for k in stored}
    used = set()
    for ours, need in wanted.items():
        key = key_of(ours)
        where = key if key in stored else tied.get(key) if tied.get(key) in stored else None
        label = repr(ours) if key == ours else f"{ours!r} (file {key!r})"
        if where is None:
            problems.append(f"{label}: needed by the model, not in the file"
                            + (f" (nor its tied source {tied[key]!r})" if key in tied else ""))
            continue
        used.add(where)
        shape, code = stored[where]
        if code not in _DTYPES:
            problems.append(f"{label}: stored as {code}, which this loader does not read (dtypes: "
                            f"{sorted(_DTYPES)}{'' if BFLOAT16 is not None else '; BF16 needs ml_dtypes'})")
            continue
        transform = _transform(transforms, ours)
        try:
            theirs = transform.stored_shape(need[0]) if need else shape
        except ValueError as e:
            problems.append(f"{label}: {e}")
            continue
        if need and (theirs != shape or _DTYPES[code] != need[1]):
            how = "" if transform is _Same else f" as {transform} gives it"
            problems.append(f"{label}: stored {_DTYPES[code].name}{list(shape)}, the model needs "
                            f"{need[1].name}{list(theirs)}{how}")
            continue
        ours_shape = _ours_shape(shape, transform)
        out[ours] = (where, ours_shape, _DTYPES[code])
    extra = sorted(set(stored) - used) if strict and any(v is not None for v in wanted.values()) else []
    problems += [f"{k!r}: in the file, but the model has no such tensor" for k in extra]
    if problems and strict:
        raise ValueError(f"a .safetensors file must match the model it is loaded into (pass strict=False for a "
                         f"partial load); got {len(problems)} mismatched tensor(s) in {path}: " + "; ".join(problems))
    return out


def _ours_shape(stored_shape: tuple, transform) -> tuple:
    if transform is _Same:
        return tuple(stored_shape)
    return tuple(stored_shape[a] for a in transform._axes(len(stored_shape)))


# ------------------------------------------------------------------ save

def save_safetensors(path, tensors, shardings=None, mesh: Mesh | None = None, *, names=None, transforms=None,
                     tied=None, metadata: dict | None = None, comm=None) -> None:
    """Collectively save sharded arrays into ONE ``.safetensors`` file PyTorch loads (see the module doc).

    ``tensors``: our name -> DArray or this rank's block (TRUE or padded), or a pytree of them (leaves named
    by dotted paths). ``shardings``: our name -> (global shape, Sharding or spec) for the blocks that are no
    DArrays, or an SPMDProgram whose inputs/outputs give them. ``names``, ``transforms``, ``tied``: as for
    ``load_safetensors`` (the alias of a tie is not written). ``metadata``: str -> str for the file's
    ``__metadata__``. Every rank passes the same names, shapes, dtypes and shardings; raises WeightsError on
    every rank if any rank fails, leaving any previous file in place.
    """
    tensors = pytree.named_leaves(tensors)
    mesh = mesh or _mesh_of(tensors, shardings)
    comm = _world(comm, mesh)
    rank = comm.Get_rank()
    final = Path(os.path.realpath(path))
    plan, error = capture(_plan_save, tensors, shardings, mesh, rank, names or {}, transforms, dict(tied or {}),
                          metadata)
    tmp = None
    if rank == 0 and error is None:
        tmp, error = capture(_create, final, plan)
    try:
        mine = None if plan is None else (plan["fingerprint"], plan["crcs"])
        gathered = agree(comm, error, "save_safetensors", (mine, None if tmp is None else str(tmp)), WeightsError)
        odd = [r for r, g in enumerate(gathered) if g[0][0] != gathered[0][0][0]]
        if odd:
            raise WeightsError(f"save_safetensors needs the same tensor names, shapes, dtypes, shardings, ties and "
                               f"metadata on every rank; got rank(s) {odd} differing from rank 0", odd)
        try:
            _check_replicas(plan, mesh, [g[0][1] for g in gathered])
        except CheckpointError as e:
            raise WeightsError(str(e).replace("save_checkpoint", "save_safetensors", 1), e.ranks) from None
        written = capture(_write_blocks, plan, mesh, rank, Path(gathered[0][1]))[1]
        agree(comm, written, "save_safetensors (writing blocks)", error_type=WeightsError)
        committed = capture(_commit, Path(gathered[0][1]), final)[1] if rank == 0 else None
        agree(comm, committed, "save_safetensors (commit)", error_type=WeightsError)
    finally:
        if tmp is not None and tmp.exists():
            tmp.unlink()


def _mesh_of(tensors: dict, shardings) -> Mesh:
    if isinstance(shardings, SPMDProgram):
        return shardings.mesh
    meshes = {x.mesh for x in tensors.values() if isinstance(x, DArray)}
    if len(meshes) != 1:
        raise TypeError(f"save_safetensors needs a mesh (mesh=, an SPMDProgram, or DArrays on one mesh); got "
                        f"{len(meshes)} meshes among the DArrays given")
    return meshes.pop()


def _plan_save(tensors: dict, shardings, mesh: Mesh, rank: int, names: dict, transforms, tied: dict,
               metadata) -> dict:
    """This rank's blocks (as ``save_checkpoint``'s plan: name -> (true block, shape, Sharding)), the file's
    header and each tensor's place in it, a cross-rank fingerprint and each block's crc32."""
    entries = _save_entries(shardings, mesh) if shardings is not None else {}
    blocks = {}
    for name in sorted(tensors):
        x = tensors[name]
        if isinstance(x, DArray):
            if x.mesh != mesh:
                raise ValueError(f"save_safetensors saves arrays of one mesh; got {name!r} on {x.mesh}, not {mesh}")
            shape, spec, x = x.shape, x.sharding, x.local
        elif name in entries:
            shape, spec = entries[name]
        else:
            raise KeyError(f"every block to save needs a (global_shape, sharding) entry (or pass a DArray); got "
                           f"none for {name!r} (entries: {sorted(entries)})")
        shape = tuple(int(n) for n in shape)
        sharding = _resolve_sharding(spec, shape, mesh, name)
        blocks[name] = (_true_block(x, shape, sharding, mesh, rank, name), shape, sharding)
    keys = {name: names.get(name, name) for name in blocks}
    clash = sorted(k for k in set(keys.values()) if list(keys.values()).count(k) > 1)
    if clash:
        raise ValueError(f"names must map each tensor to a file name of its own; got {clash} named by "
                         f"{sorted(n for n, k in keys.items() if k in clash)}")
    _check_ties(blocks, keys, tied)
    layout = _layout(blocks, keys, transforms, tied)
    header = _header(layout, tied, metadata)
    fingerprint = (header, [(n, sh.to_json()) for n, (_, _, sh) in blocks.items()])
    return {"tensors": blocks, "keys": keys, "layout": layout, "header": header, "fingerprint": fingerprint,
            "transforms": transforms, "crcs": [_crc(b) for b, _, _ in blocks.values()]}


def _check_ties(blocks: dict, keys: dict, tied: dict) -> None:
    """An alias saved with its source must have the source's layout and bytes (only the source is stored)."""
    by_key = {k: n for n, k in keys.items()}
    for alias, source in tied.items():
        if alias not in by_key:
            continue
        if source not in by_key:
            raise ValueError(f"a tied tensor is stored under its source's name; got alias {alias!r} without its "
                             f"source {source!r} among the tensors to save (pass both, or neither tie)")
        (a, sa, sha), (b, sb, shb) = blocks[by_key[alias]], blocks[by_key[source]]
        if (sa, a.dtype, sha) != (sb, b.dtype, shb) or a.tobytes() != b.tobytes():
            raise ValueError(f"tied tensors must be equal (only {source!r} is stored); got {alias!r} "
                             f"{a.dtype.name}{list(sa)} {sha} differing from {source!r} {b.dtype.name}{list(sb)} "
                             f"{shb} in this rank's block")


def _layout(blocks: dict, keys: dict, transforms, tied: dict) -> dict:
    """File key -> (our name, stored shape, dtype, byte offset in the data): the tensors written, laid out as
    safetensors' own writer does (by dtype in ``_CODES`` order, then by name: the same bytes as its file)."""
    rows = []
    for name, (block, shape, _) in blocks.items():
        if keys[name] in tied:
            continue
        if block.dtype.name not in _CODES:  # a byte-swapped dtype has its native one's name: written native
            raise TypeError(f"safetensors stores {sorted(_CODES)}; got dtype {block.dtype} for {name!r}")
        rows.append((_ORDER[block.dtype.name], keys[name], name, _transform(transforms, name).stored_shape(shape),
                     np.dtype(block.dtype.name)))
    layout, offset = {}, 0
    for _, key, name, shape, dtype in sorted(rows):
        layout[key] = (name, shape, dtype, offset)
        offset += math.prod(shape) * dtype.itemsize
    return layout


def _header(layout: dict, tied: dict, metadata) -> bytes:
    """The file's first bytes: its header's length (u64, little-endian) and the JSON header, padded with
    spaces to 8 bytes (as safetensors' own writer pads it)."""
    meta = dict(metadata or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise TypeError(f"safetensors metadata maps str to str; got {meta!r}")
    if tied:
        meta[TIED_KEY] = json.dumps(dict(sorted(tied.items())))
    doc = {"__metadata__": meta} if meta else {}
    for key, (_, shape, dtype, offset) in layout.items():
        doc[key] = {"dtype": _CODES[dtype.name], "shape": list(shape),
                    "data_offsets": [offset, offset + math.prod(shape) * dtype.itemsize]}
    text = json.dumps(doc, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def _create(final: Path, plan: dict) -> Path:
    """Rank 0: the sibling tmp file, holding the header and sized to the whole file."""
    if final.is_dir():
        raise IsADirectoryError(f"save_safetensors writes a file; got the directory {final}")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f"{final.name}.tmp-{uuid.uuid4().hex}")
    size = len(plan["header"]) + sum(math.prod(s) * d.itemsize for _, s, d, _ in plan["layout"].values())
    with open(tmp, "wb") as f:
        f.write(plan["header"])
        f.truncate(size)
    return tmp


def _write_blocks(plan: dict, mesh: Mesh, rank: int, tmp: Path) -> None:
    """Write the blocks this rank is the writer of, in the file's layout, at their byte offsets."""
    start = len(plan["header"])
    fd = os.open(tmp, os.O_WRONLY)
    try:
        for key, (name, shape, dtype, offset) in plan["layout"].items():
            block, ours, sharding = plan["tensors"][name]
            if not block.size or not _is_writer(sharding, mesh, rank):
                continue
            transform = _transform(plan["transforms"], name)
            where = transform.stored_slices(local_block_slices(ours, sharding, mesh, rank))
            _pwrite_block(fd, start + offset, shape, where, transform.to_stored(block.astype(dtype, copy=False)))
        os.fsync(fd)
    finally:
        os.close(fd)


def _pwrite_block(fd: int, base: int, shape: tuple, where: tuple, block: np.ndarray) -> None:
    """Write the C-contiguous ``block`` at ``where`` (slices) of a row-major tensor of ``shape`` starting at byte
    ``base``: one write per contiguous run (the dims after the last one the block does not span are whole)."""
    split = [d for d in range(len(shape)) if block.shape[d] != shape[d]]
    lead = split[-1] if split else 0  # runs: one per index of the dims before ``lead``
    strides = [math.prod(shape[d + 1:]) * block.itemsize for d in range(len(shape))]  # bytes per step along d
    runs = block.reshape(math.prod(block.shape[:lead]), -1).view(np.uint8)  # bytes: any dtype, bfloat16 too
    first = base + sum(s.start * st for s, st in zip(where, strides))
    for i, index in enumerate(product(*(range(n) for n in block.shape[:lead]))):
        data = memoryview(runs[i])
        at = first + sum(j * st for j, st in zip(index, strides))
        while data:
            done = os.pwrite(fd, data, at)
            data, at = data[done:], at + done


def _commit(tmp: Path, final: Path) -> None:
    """Rank 0: the complete file replaces ``final`` in one rename."""
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------ sharded checkpoints

def safetensors_to_checkpoint(path, directory, mesh: Mesh, shardings=None, *, names=None, transforms=None,
                              tied=None, expect=None, strict: bool = True, step=None, comm=None) -> None:
    """Collective: a ``.safetensors`` state dict as a sharded checkpoint (``load_safetensors`` then
    ``save_checkpoint``; each rank reads only its blocks and writes those it is the writer of). Name the
    tensors as the checkpoint's reader does (``names={"params.wte": "transformer.wte.weight", ...}`` for a
    ``TrainStep``, which then loads it with ``strict=False`` when it holds no optimizer state)."""
    comm = _world(comm, mesh)
    loaded, error = capture(_load_local, path, mesh, shardings, comm.Get_rank(), names, transforms, tied, expect,
                            strict)
    agree(comm, error, "safetensors_to_checkpoint", error_type=WeightsError)
    save_checkpoint(directory, {n: b for n, (b, _, _) in loaded.items()},
                    {n: (shape, sh) for n, (_, shape, sh) in loaded.items()}, mesh, comm=comm, step=step)


def checkpoint_to_safetensors(directory, path, mesh: Mesh, shardings=None, *, tensors=None, names=None,
                              transforms=None, tied=None, metadata=None, comm=None) -> None:
    """Collective: (some of) a sharded checkpoint as one ``.safetensors`` file. ``tensors``: the checkpoint
    names to convert (default all; e.g. a ``TrainStep``'s ``params.*`` without its optimizer state).
    ``shardings``: name -> spec (or an SPMDProgram), how the ranks hold the blocks on the way; a tensor not
    named keeps its saved sharding when ``mesh`` is the one that saved it, else it is read replicated (each
    rank then reads it whole)."""
    comm = _world(comm, mesh)
    plan, error = capture(_conversion, directory, mesh, shardings, tensors)
    agree(comm, error, "checkpoint_to_safetensors", error_type=WeightsError)
    specs, expect = plan
    blocks = load_checkpoint(directory, mesh, specs, comm=comm, expect=expect, strict=False)
    save_safetensors(path, blocks, {n: (expect[n][0], specs[n]) for n in blocks}, mesh, names=names,
                     transforms=transforms, tied=tied, metadata=metadata, comm=comm)


def _conversion(directory, mesh: Mesh, shardings, tensors) -> tuple[dict, dict]:
    """(name -> Sharding, name -> (shape, dtype)) of the checkpoint tensors to convert."""
    info = checkpoint_info(directory)
    stored = info["tensors"]
    chosen = sorted(stored if tensors is None else tensors)
    missing = sorted(set(chosen) - set(stored))
    if missing:
        raise KeyError(f"checkpoint_to_safetensors converts tensors the checkpoint holds; got {missing} not among "
                       f"{sorted(stored)} in {directory}")
    given, same_mesh = _load_specs(shardings, mesh, stored), Mesh.from_json(info["mesh"]) == mesh
    specs = {}
    for n in chosen:
        saved = Sharding.from_json(stored[n]["sharding"]) if same_mesh else Sharding.replicated(len(stored[n]["shape"]))
        specs[n] = given.get(n, saved)
    return specs, {n: (tuple(stored[n]["shape"]), stored[n]["dtype"]) for n in chosen}


__all__ = ["load_safetensors", "save_safetensors", "safetensors_to_checkpoint", "checkpoint_to_safetensors",
           "Transpose", "WeightsError", "TIED_KEY"]
