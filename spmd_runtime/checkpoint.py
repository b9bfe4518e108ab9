"""Sharded checkpoints: every rank writes and reads only its own blocks.

A checkpoint is a directory holding one ``.npy`` file per distinct block of each
tensor plus ``checkpoint.json``::

    ckpt/checkpoint.json         format, version, step, mesh, and per tensor:
                                 global shape, dtype, sharding and its blocks
                                 [{"file", "offset", "shape"}, ...]
    ckpt/<name>.<i0>.<i1>.npy    block (i0, i1) of tensor <name> (shard number
                                 per dim), raw NumPy, no pickles

Blocks hold TRUE (unpadded) contents at their global offsets (dim of size n
over k shards: shard i holds [i*c, min((i+1)*c, n)), c = ceil(n/k); empty
blocks are not stored), so a checkpoint does not depend on padding and can be
restored onto any mesh and sharding: each rank reads (memory-mapped) only the
stored blocks that overlap its own block. Only the replica whose coordinates on
the axes not splitting the tensor are all 0 writes a block, so no data moves
between ranks.

Saving is atomic: blocks go to a sibling ``<dir>.tmp-<uuid>``; once every rank
has written (agreed collectively, so a failing rank makes every rank raise),
rank 0 renames the old ``<dir>`` to ``<dir>.old-<uuid>``, the new one into
place, then deletes the old one. A job killed at any point leaves a loadable
checkpoint: ``<dir>`` itself, or ``<dir>.old-*`` when it died between the two
renames, which ``load_checkpoint`` falls back to. One saver per directory at a
time.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import uuid
import zlib
from dataclasses import dataclass
from itertools import product
from pathlib import Path

import numpy as np

from .comm.agreement import AgreedError, agree, capture
from .comm.communicator import world
from .exec.backend import to_host
from .mesh import Mesh
from . import pytree
from .program import SPMDProgram
from .sharding import Sharding, parse_spec

FORMAT = "spmd_runtime.checkpoint"
FORMAT_VERSION = 1
METADATA = "checkpoint.json"


class CheckpointError(AgreedError):
    """A save or load failed on some rank; raised on every rank."""


# ------------------------------------------------------------------ layout

def local_block_slices(shape, sharding: Sharding, mesh: Mesh, rank: int) -> tuple[slice, ...]:
    """Where ``rank``'s TRUE block lies in the global array (the layout rule: ``Sharding.block_slices``)."""
    return sharding.block_slices(shape, mesh, rank)


def _is_writer(sharding: Sharding, mesh: Mesh, rank: int) -> bool:
    # Replicas differ only on the axes that do not split the tensor; coordinate 0 there picks one.
    coords = mesh.coords(rank)
    return all(coords[a] == 0 for a in mesh.axis_names if a not in sharding.axes)


def _all_blocks(shape, sharding: Sharding, mesh: Mesh):
    """Every non-empty block: (shard index per dim, bounds)."""
    counts = [mesh.axis_size(axes) for axes in sharding.dims]
    for index in product(*(range(k) for k in counts)):
        bounds = sharding.block_bounds(shape, mesh, index)
        if all(b > a for a, b in bounds):
            yield index, bounds


def _file_names(names) -> dict[str, str]:
    """A distinct, filesystem-safe file stem per tensor name (deterministic, so every rank agrees)."""
    stems, taken = {}, set()
    for name in sorted(names):
        base = re.sub(r"[^A-Za-z0-9_-]", "_", name)[:100] or "tensor"
        stem, n = base, 1
        while stem.lower() in taken:  # case-insensitive filesystems
            stem, n = f"{base}_{n}", n + 1
        taken.add(stem.lower())
        stems[name] = stem
    return stems


def _block_file(stem: str, index) -> str:
    return ".".join([stem, *map(str, index), "npy"])


# ------------------------------------------------------------------ specs

def _resolve_sharding(spec, shape, mesh: Mesh, name: str) -> Sharding:
    """A Sharding that fits ``shape`` on ``mesh``; raises ValueError/TypeError otherwise."""
    what = f"tensor {name!r} of shape {tuple(shape)}"
    sharding = parse_spec(spec, mesh, len(shape), what)
    if sharding.ndim != len(shape):
        raise ValueError(f"a sharding needs one entry per dim of {what}; got {sharding} with {sharding.ndim}")
    for axis in sharding.axes + sharding.partial:
        mesh.axis_index(axis)
    if sharding.partial:
        raise ValueError(f"a checkpointed tensor must hold final values (reduce partial sums first); got "
                         f"{what} with sharding {sharding}")
    return sharding


def _program_entries(program: SPMDProgram, mesh: Mesh, what: str) -> dict:
    """name -> (global shape, Sharding) of a program's inputs and outputs."""
    if program.mesh != mesh:
        raise ValueError(f"{what} with a program needs the program's mesh; got {mesh} for a program on {program.mesh}")
    return {io.name: (io.shape, io.sharding) for io in program.inputs + program.outputs}


def _save_entries(shardings, mesh: Mesh) -> dict:
    """name -> (global shape, spec) from a dict or an SPMDProgram."""
    if isinstance(shardings, SPMDProgram):
        return _program_entries(shardings, mesh, "save_checkpoint")
    return dict(shardings)


def _load_specs(shardings, mesh: Mesh, stored) -> dict:
    """name -> spec; a program contributes only the values the checkpoint holds (its others are not restored)."""
    if isinstance(shardings, SPMDProgram):
        entries = _program_entries(shardings, mesh, "load_checkpoint")
        return {name: sh for name, (_, sh) in entries.items() if name in stored}
    return dict(shardings or {})


# ------------------------------------------------------------------ collectives

def _world(comm, mesh: Mesh):
    comm = world(comm)
    if comm.Get_size() != mesh.size:
        raise ValueError(f"a checkpoint needs one process per mesh device; got {comm.Get_size()} processes for "
                         f"{mesh} with {mesh.size} devices")
    return comm


def _agree(comm, error: str | None, what: str, payload=None) -> list:
    """Collective: raise CheckpointError on EVERY rank if any rank has an error; returns every rank's payload."""
    return agree(comm, error, what, payload, CheckpointError)


# ------------------------------------------------------------------ save

def save_checkpoint(directory, tensors: dict, shardings, mesh: Mesh | None = None, comm=None, step=None) -> None:
    """Collectively save this rank's shards of ``tensors`` into ``directory`` (atomically replaced).

    ``tensors``: name -> this rank's local block (its TRUE shape, or the padded
    ceil-size block, which is cut), or any pytree of blocks: leaves are named by
    their dotted paths (``{"params": {"w1": b}}`` saves ``params.w1``, the name
    ``sr.trace`` gives that leaf). ``shardings``: name -> (global shape,
    Sharding or mesh_split spec), or an SPMDProgram whose inputs/outputs give
    them by name (``mesh`` then defaults to the program's). Every rank must
    pass the same names, global shapes, dtypes, shardings and ``step``.
    Raises CheckpointError on every rank if any rank fails; the previous
    checkpoint then stays in place.
    """
    tensors = pytree.named_leaves(tensors)  # a flat dict of arrays stays as it is
    if mesh is None and isinstance(shardings, SPMDProgram):
        mesh = shardings.mesh
    if not isinstance(mesh, Mesh):
        raise TypeError(f"save_checkpoint needs a Mesh (or an SPMDProgram as shardings); got mesh={mesh!r}")
    comm = _world(comm, mesh)
    rank = comm.Get_rank()
    final = Path(os.path.abspath(directory))
    plan, error = capture(_plan_save, tensors, shardings, mesh, rank)
    tmp = None
    if rank == 0 and error is None:
        tmp, error = capture(_make_tmp, final)
    try:
        fingerprint = None if plan is None else (plan["fingerprint"], step)
        gathered = _agree(comm, error, "save_checkpoint", (fingerprint, tmp))
        _check_same(gathered)
        where = Path(gathered[0][1])
        crcs, error = capture(_write_blocks, plan, mesh, rank, where)
        crcs = _agree(comm, error, "save_checkpoint (writing blocks)", crcs)
        committed = capture(_publish, plan, mesh, where, final, step, crcs)[1] if rank == 0 else None
        _agree(comm, committed, "save_checkpoint (commit)")
    finally:
        if tmp is not None and tmp.exists():  # a failed save leaves nothing behind (rank 0 owns the tmp dir)
            shutil.rmtree(tmp, ignore_errors=True)


def _plan_save(tensors, shardings, mesh: Mesh, rank: int) -> dict:
    """Validate this rank's inputs: name -> (true host block, global shape, Sharding), and a cross-rank fingerprint."""
    entries = _save_entries(shardings, mesh)
    plan = {}
    for name in sorted(tensors):
        if name not in entries:
            raise KeyError(f"every tensor to save needs a (global_shape, sharding) entry; got none for {name!r} "
                           f"(entries: {sorted(entries)})")
        shape, spec = entries[name]
        shape = tuple(int(n) for n in shape)
        sharding = _resolve_sharding(spec, shape, mesh, name)
        plan[name] = (_true_block(tensors[name], shape, sharding, mesh, rank, name), shape, sharding)
    fingerprint = [(n, s, b.dtype.str, sh.to_json()) for n, (b, s, sh) in plan.items()]
    return {"tensors": plan, "fingerprint": fingerprint}


def _true_block(x, shape, sharding: Sharding, mesh: Mesh, rank: int, name: str) -> np.ndarray:
    """This rank's block as stored: the true block, cut from a padded one if need be."""
    x = to_host(x)
    if x.dtype.hasobject:
        raise TypeError(f"a checkpointed tensor must have a plain dtype (no Python objects); got {x.dtype} for "
                        f"{name!r}")
    bounds = sharding.block_bounds(shape, mesh, sharding.block_index(mesh, rank))
    true = tuple(b - a for a, b in bounds)
    padded = sharding.local_shape(shape, mesh)
    if x.shape == true:
        return x
    if x.shape == padded:
        return x[tuple(slice(0, t) for t in true)]
    either = f"true shard shape {true}" + ("" if padded == true else f" or the padded {padded}")
    raise ValueError(f"the local block of {name!r} (global shape {shape}, sharding {sharding}) must have this rank's "
                     f"{either}; got shape {x.shape}")


def _check_same(gathered) -> None:
    # Every rank holds the same gathered list, so every rank raises alike: no extra collective needed.
    mine = gathered[0][0]
    odd = [r for r, (fp, _) in enumerate(gathered) if fp != mine]
    if odd:
        raise CheckpointError(f"save_checkpoint needs the same tensor names, global shapes, dtypes, shardings and "
                              f"step on every rank; got rank(s) {odd} differing from rank 0")


def _make_tmp(final: Path) -> Path:
    if final.exists() and not (final / METADATA).is_file() and (not final.is_dir() or any(final.iterdir())):
        # Replacing deletes the old directory: only ever do that to a checkpoint.
        raise FileExistsError(f"save_checkpoint replaces only an earlier checkpoint (a directory with {METADATA}) "
                              f"or an empty directory; got {final}, which is neither")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f"{final.name}.tmp-{uuid.uuid4().hex}")
    tmp.mkdir()
    return tmp


def _write_blocks(plan, mesh: Mesh, rank: int, where: Path) -> dict:
    """Write this rank's blocks; returns file -> crc32 of its data."""
    stems, crcs = _file_names(plan["tensors"]), {}
    for name, (block, shape, sharding) in plan["tensors"].items():
        if block.size and _is_writer(sharding, mesh, rank):
            file = _block_file(stems[name], sharding.block_index(mesh, rank))
            _write_npy(where / file, block)
            crcs[file] = _crc(block)
    return crcs


def _crc(block: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(block).view(np.uint8).reshape(-1))


def _publish(plan, mesh: Mesh, where: Path, final: Path, step, crcs: list) -> None:
    """Rank 0: write the metadata (with every rank's block checksums), then commit."""
    _write_json(where / METADATA, _metadata(plan, mesh, _file_names(plan["tensors"]), step,
                                            {f: c for rank_crcs in crcs for f, c in rank_crcs.items()}))
    _commit(where, final)


def _metadata(plan, mesh: Mesh, stems, step, crcs: dict) -> dict:
    tensors = {}
    for name, (block, shape, sharding) in plan["tensors"].items():
        blocks = []
        for index, bounds in _all_blocks(shape, sharding, mesh):
            file = _block_file(stems[name], index)
            blocks.append({"file": file, "offset": [a for a, _ in bounds], "shape": [b - a for a, b in bounds],
                           "crc32": crcs[file]})
        tensors[name] = {"shape": list(shape), "dtype": block.dtype.str, "sharding": sharding.to_json(),
                         "blocks": blocks}
    return {"format": FORMAT, "version": FORMAT_VERSION, "step": step, "mesh": mesh.to_json(), "tensors": tensors}


def _write_npy(path: Path, block: np.ndarray) -> None:
    with open(path, "wb") as f:
        np.save(f, block, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())  # durable before the rename publishes it


def _write_json(path: Path, doc: dict) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _commit(tmp: Path, final: Path) -> None:
    """Rank 0: publish ``tmp`` as ``final``; the old checkpoint survives until the new one is in place."""
    _fsync_dir(tmp)  # the entries every rank created
    old = final.with_name(f"{final.name}.old-{tmp.name.rsplit('.tmp-', 1)[1]}")
    had_old = final.exists()
    if had_old:
        os.rename(final, old)
    try:
        os.rename(tmp, final)
    except Exception:
        if had_old:
            os.rename(old, final)
        raise
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)
    for stale in _siblings(final, ".old-") + _siblings(final, ".tmp-"):  # left by jobs killed mid-save
        shutil.rmtree(stale, ignore_errors=True)


def _siblings(final: Path, tag: str) -> list[Path]:
    if not final.parent.is_dir():
        return []
    return [p for p in final.parent.iterdir() if p.name.startswith(final.name + tag) and p.is_dir()]


# ------------------------------------------------------------------ load

@dataclass(frozen=True)
class StackOf:
    """A view: the tensor is its ``parts`` stacked on a new leading dim (part i is slice i), e.g. a
    stacked-layers weight [layers, ...] stored as one tensor per layer."""
    parts: tuple[str, ...]


@dataclass(frozen=True)
class SliceOf:
    """A view: the tensor is slice ``index`` of the leading dim of ``source``, e.g. one layer's weight
    stored inside a stacked-layers tensor."""
    source: str
    index: int



def load_checkpoint(directory, mesh: Mesh, shardings=None, comm=None, expect=None, strict: bool = True,
                    verify: bool | None = None, like=None, views=None):
    """Collectively load every tensor of a checkpoint: name -> this rank's TRUE local block.

    ``shardings``: name -> Sharding or mesh_split spec on ``mesh`` (any mesh
    and sharding, not necessarily the saved ones), or an SPMDProgram (its
    inputs/outputs that the checkpoint holds); tensors not named come back
    replicated. ``expect``: name -> (global shape, dtype) the caller needs (a
    program's inputs/outputs are expected at their shapes too); with ``strict``
    any missing, extra or differently shaped/typed tensor fails the load, naming
    each; ``strict=False`` loads only the tensors that match. ``verify``
    (default True, or ``SPMD_CHECKPOINT_VERIFY=0``) checks each block read
    against its crc32 in the metadata. Block files that are symlinks are
    refused. Each rank memory-maps only the stored blocks that overlap its
    own block. ``views``: name -> ``StackOf`` / ``SliceOf``, how to read a tensor the checkpoint stores in
    another layout (used only for names it does not hold, when it holds every source); each rank still
    reads only the overlapping parts of the sources. Raises CheckpointError on every rank if any rank fails.
    """
    comm = _world(comm, mesh)
    if verify is None:
        verify = os.environ.get("SPMD_CHECKPOINT_VERIFY", "1").strip().lower() not in ("0", "off", "no", "false")
    out, error = capture(_load_local, directory, mesh, shardings, comm.Get_rank(), expect, strict, verify, views)
    if error is None and like is not None:  # ``like``: a pytree whose dotted leaf paths name the tensors
        out, error = capture(_like, out, like)
    _agree(comm, error, "load_checkpoint")
    return out


def _like(loaded: dict, like):
    paths, tree = pytree.flatten_with_path(like)
    names = [pytree.keystr(p) for p, _ in paths]
    missing = [n for n in names if n not in loaded]
    if missing:
        raise KeyError(f"like= names tensors the checkpoint holds; got {missing} not among {sorted(loaded)}")
    return tree.unflatten(loaded[n] for n in names)


def checkpoint_info(directory) -> dict:
    """The metadata of the checkpoint in ``directory`` (format, version, step, mesh, tensors with their blocks)."""
    return _read_metadata(_find_checkpoint(directory))


def _load_local(directory, mesh: Mesh, shardings, rank: int, expect, strict: bool, verify: bool, views) -> dict:
    path = _find_checkpoint(directory)
    meta = _read_metadata(path)
    stored = _matching(_with_views(meta["tensors"], views or {}, path), _expected(shardings, expect),
                       set(expect or ()), expect is not None, strict, path)
    specs = _load_specs(shardings, mesh, stored)
    unknown = sorted(set(specs) - set(stored) - (set(meta["tensors"]) if not strict else set()))
    if unknown:
        raise KeyError(f"load_checkpoint shardings must name tensors of the checkpoint {sorted(stored)}; got "
                       f"unknown name(s) {unknown}")
    out = {}
    for name, entry in stored.items():
        shape = tuple(entry["shape"])
        sharding = _resolve_sharding(specs.get(name, Sharding.replicated(len(shape))), shape, mesh, name)
        out[name] = _assemble(path, name, entry, shape, sharding, mesh, rank, verify)
    return out


def _with_views(stored: dict, views: dict, path: Path) -> dict:
    """``stored`` with an entry per view whose sources it holds all of (the sources then leave it)."""
    entries, used = dict(stored), set()
    for name, view in views.items():
        sources = view.parts if isinstance(view, StackOf) else (view.source,)
        if name in stored or not sources or any(s not in stored for s in sources):
            continue
        first = stored[sources[0]]
        if isinstance(view, StackOf):
            odd = [s for s in sources if (stored[s]["shape"], stored[s]["dtype"]) != (first["shape"], first["dtype"])]
            if odd:
                raise ValueError(f"the parts of stacked tensor {name!r} must share one shape and dtype; got {odd} "
                                 f"differing from {sources[0]!r} {first['dtype']}{first['shape']} in {path}")
            shape = [len(sources)] + list(first["shape"])
        else:
            if not first["shape"] or not 0 <= view.index < first["shape"][0]:
                raise ValueError(f"{name!r} is slice {view.index} of the leading dim of {view.source!r}; got "
                                 f"shape {first['shape']} in {path}")
            shape = list(first["shape"][1:])
        entries[name] = {"shape": shape, "dtype": first["dtype"], "view": view,
                         "sources": {s: stored[s] for s in sources}}
        used.update(sources)
    return {n: e for n, e in entries.items() if n not in used}


def _expected(shardings, expect) -> dict:
    """name -> (shape, dtype) the caller needs: ``expect``, plus a program's inputs/outputs at their shapes."""
    wanted = {}
    if isinstance(shardings, SPMDProgram):
        wanted = {io.name: (tuple(io.shape), np.dtype(io.dtype).str) for io in shardings.inputs + shardings.outputs}
    for name, (shape, dtype) in (expect or {}).items():
        wanted[name] = (tuple(int(n) for n in shape), np.dtype(dtype).str)
    return wanted


def _matching(stored: dict, wanted: dict, required: set, exact_names: bool, strict: bool, path: Path) -> dict:
    """The stored entries to load; with ``strict``, raise naming every tensor that does not fit ``wanted``."""
    problems, keep = [], {}
    for name, entry in stored.items():
        have = (tuple(entry["shape"]), np.dtype(entry["dtype"]).str)
        if name in wanted and have != wanted[name]:
            want = wanted[name]
            problems.append(f"{name!r}: stored {np.dtype(have[1]).name}{list(have[0])}, the model needs "
                            f"{np.dtype(want[1]).name}{list(want[0])}")
        elif exact_names and name not in wanted:
            problems.append(f"{name!r}: stored, but the model has no such tensor")
        else:
            keep[name] = entry
    if exact_names:
        problems += [f"{name!r}: needed by the model, not in the checkpoint" for name in sorted(required - set(stored))]
    if problems and strict:
        raise ValueError(f"a checkpoint must match the model it is loaded into (pass strict=False for a partial "
                         f"load); got {len(problems)} mismatched tensor(s) in {path}: " + "; ".join(problems))
    return keep


def _assemble(path: Path, name: str, entry: dict, shape, sharding: Sharding, mesh: Mesh, rank: int,
              verify: bool) -> np.ndarray:
    """This rank's block, copied from the overlapping parts of the stored blocks (or of a view's sources)."""
    return _read(path, name, entry, sharding.block_bounds(shape, mesh, sharding.block_index(mesh, rank)), verify)


def _read(path: Path, name: str, entry: dict, mine, verify: bool) -> np.ndarray:
    """The block ``mine`` (bounds per dim) of the stored tensor or view ``entry``."""
    view = entry.get("view")
    if isinstance(view, SliceOf):
        return _read(path, view.source, entry["sources"][view.source], [(view.index, view.index + 1)] + list(mine),
                     verify)[0]
    if isinstance(view, StackOf):
        (a, b), rest = mine[0], mine[1:]
        out = np.empty([b - a] + [hi - lo for lo, hi in rest], dtype=np.dtype(entry["dtype"]))
        for j in range(a, b):
            out[j - a] = _read(path, view.parts[j], entry["sources"][view.parts[j]], rest, verify)
        return out
    out = np.empty([b - a for a, b in mine], dtype=np.dtype(entry["dtype"]))
    filled = 0
    for blk in entry["blocks"]:
        part = [(max(a, o), min(b, o + s)) for (a, b), o, s in zip(mine, blk["offset"], blk["shape"])]
        if any(hi <= lo for lo, hi in part):
            continue
        data = _open_block(path, name, blk, out.dtype, verify)
        src = tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(part, blk["offset"]))
        out[tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(part, mine))] = data[src]
        filled += math.prod(hi - lo for lo, hi in part)
    if filled != out.size:  # stored blocks are disjoint, so a shortfall means a gap
        raise ValueError(f"the stored blocks of {name!r} must cover the whole tensor; got {filled} of the "
                         f"{out.size} elements of block {mine} in {path} (corrupt metadata)")
    return out


def _open_block(path: Path, name: str, blk: dict, dtype, verify: bool) -> np.ndarray:
    file = blk["file"]
    if Path(file).name != file:  # metadata must not point outside the checkpoint
        raise ValueError(f"a block file of {name!r} must be a plain file name; got {file!r} in {path}")
    if (path / file).is_symlink():
        raise ValueError(f"a block file must be a regular file, not a symlink; got {file} of {name!r} -> "
                         f"{os.readlink(path / file)} in {path}")
    try:
        data = np.load(path / file, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise ValueError(f"block file {file} of {name!r} must be a readable .npy file; got {type(e).__name__}: "
                         f"{e} in {path} (corrupt header or truncated)") from None
    if list(data.shape) != list(blk["shape"]) or data.dtype != dtype:
        raise ValueError(f"block file {file} of {name!r} must hold {np.dtype(dtype).name}{list(blk['shape'])}; got "
                         f"{data.dtype.name}{list(data.shape)} in {path} (corrupt or replaced)")
    if verify and "crc32" in blk and _crc(data) != blk["crc32"]:
        raise ValueError(f"block file {file} of {name!r} must match its crc32 {blk['crc32']:08x} in {METADATA}; got "
                         f"{_crc(data):08x} in {path} (corrupt; SPMD_CHECKPOINT_VERIFY=0 skips this check)")
    return data


def _find_checkpoint(directory) -> Path:
    """``directory``, or the previous checkpoint a save killed between its two renames left as ``<dir>.old-*``."""
    final = Path(os.path.abspath(directory))
    if (final / METADATA).is_file():
        return final
    if final.exists():
        raise FileNotFoundError(f"a checkpoint directory must hold {METADATA}; got none in {final}")
    olds = [p for p in _siblings(final, ".old-") if (p / METADATA).is_file()]
    if olds:
        return max(olds, key=lambda p: (p / METADATA).stat().st_mtime)
    raise FileNotFoundError(f"load_checkpoint needs an existing checkpoint directory; got no {final} (nor a "
                            f"{final.name}.old-* left by an interrupted save)")


def _read_metadata(path: Path) -> dict:
    with open(path / METADATA) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
        raise ValueError(f"a checkpoint has format {FORMAT} version {FORMAT_VERSION}; got {meta.get('format')!r} "
                         f"version {meta.get('version')!r} in {path / METADATA}")
    return meta


__all__ = ["save_checkpoint", "load_checkpoint", "checkpoint_info", "CheckpointError", "local_block_slices", "StackOf",
           "SliceOf"]
