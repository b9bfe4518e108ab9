"""Sharded checkpoints: every rank writes and reads only its own blocks.

A checkpoint is a directory holding one ``.npy`` file per distinct block of each
tensor plus ``checkpoint.json``::

    ckpt/checkpoint.json         format, version, step, mesh, and per tensor:
                                 global shape, dtype, sharding and its blocks
                                 [{"file", "offset", "shape", "crc32"}, ...]
    ckpt/<name>.<i0>.<i1>.npy    block (i0, i1) of tensor <name> (shard number
                                 per dim), raw NumPy, no pickles

Blocks hold TRUE (unpadded) contents at their global offsets (dim of size n
over k shards: shard i holds [i*c, min((i+1)*c, n)), c = ceil(n/k); empty
blocks are not stored), so a checkpoint does not depend on padding and can be
restored onto any mesh and sharding: each rank reads (memory-mapped) only the
stored blocks that overlap its own block. Only the replica whose coordinates on
the axes not splitting the tensor are all 0 writes a block, so no data moves
between ranks; the other replicas' copies must be bit-identical to it (each
rank's crc32 of its block is agreed on before anything is written: a copy that
differs fails the save on every rank, naming the tensor and the ranks).

Nothing read is trusted. Before any block is read the metadata is checked: per
tensor, the blocks must tile the global shape exactly once (an overlap or a gap
fails, naming the tensor and the region), and every block must carry its crc32
unless verification is off (``verify=False`` or ``SPMD_CHECKPOINT_VERIFY=0``);
each block read is checked against it. ``checkpoint.json`` and the block files
must be regular files with a single link: a symlink (which may leave the
directory) or a hard-linked file (whose other name may be anywhere) is refused;
copy such files in with ``cp`` (no ``-l``/``-s``).

Saving is atomic: rank 0 makes a sibling ``<dir>.tmp-<id>`` holding a marker
(``.spmd_checkpoint_save.json``: this save's id and the files it will write),
every rank writes its blocks there, and once every rank has written (agreed
collectively, so a failing rank makes every rank raise) rank 0 writes the
metadata, marks the old ``<dir>`` with the files ITS metadata lists, renames it
to ``<dir>.old-<id>``, renames the new one into place, moves whatever else was
in the old directory (the user's own files) into the new one and deletes only
the listed files. A job killed at any point leaves a loadable checkpoint:
``<dir>`` itself, or ``<dir>.old-*`` when it died between the two renames,
which ``load_checkpoint`` falls back to. A later save cleans up such leftovers
the same way, but only siblings named ``<dir>.tmp-<id>`` / ``<dir>.old-<id>``
whose marker names that id: a directory that merely has such a name is never
touched, and a save deletes nothing its own manifest does not list. One saver
per directory at a time; a ``<dir>`` that is a symlink is resolved first (the
link keeps pointing at the new checkpoint).
"""
from __future__ import annotations

import json
import math
import os
import re
import stat
import uuid
import warnings
import zlib
from dataclasses import dataclass
from itertools import product
from pathlib import Path

import numpy as np

from .comm.agreement import AgreedError, agree, capture
from .comm.communicator import world
from .dtypes import BFLOAT16
from .exec.backend import to_host
from .mesh import Mesh
from .npy import load_npy
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
    pass the same names, global shapes, dtypes, shardings and ``step``, and the
    ranks holding the same block of a replicated tensor bit-identical copies of
    it (cost: every rank takes one crc32 of its blocks, the one the writer's
    metadata needs anyway, and the ranks all-gather one int per tensor).
    Raises CheckpointError on every rank if any rank fails; the previous
    checkpoint then stays in place. Replacing a checkpoint deletes only the
    files its metadata lists; other files in it move into the new one.
    """
    tensors = pytree.named_leaves(tensors)  # a flat dict of arrays stays as it is
    if mesh is None and isinstance(shardings, SPMDProgram):
        mesh = shardings.mesh
    if not isinstance(mesh, Mesh):
        raise TypeError(f"save_checkpoint needs a Mesh (or an SPMDProgram as shardings); got mesh={mesh!r}")
    comm = _world(comm, mesh)
    rank = comm.Get_rank()
    final = Path(os.path.realpath(directory))  # a symlinked <dir>: the save replaces what it points at
    plan, error = capture(_plan_save, tensors, shardings, mesh, rank)
    staging = None
    if rank == 0 and error is None:
        staging, error = capture(_stage, final, plan, mesh)
    try:
        mine = None if plan is None else (plan["fingerprint"], step, plan["crcs"])
        gathered = _agree(comm, error, "save_checkpoint", (mine, None if staging is None else str(staging.tmp)))
        _check_same([g[0][:2] for g in gathered])
        crcs = [g[0][2] for g in gathered]
        _check_replicas(plan, mesh, crcs)
        where = Path(gathered[0][1])
        _agree(comm, capture(_write_blocks, plan, mesh, rank, where)[1], "save_checkpoint (writing blocks)")
        committed = capture(_publish, plan, mesh, staging, final, step, crcs)[1] if rank == 0 else None
        _agree(comm, committed, "save_checkpoint (commit)")
    finally:
        if staging is not None and staging.tmp.is_dir():  # a failed save leaves nothing behind (rank 0 made it)
            _tidy(final, lambda: _discard(staging.tmp, staging.files))


def _plan_save(tensors, shardings, mesh: Mesh, rank: int) -> dict:
    """Validate this rank's inputs: name -> (true host block, global shape, Sharding), a cross-rank
    fingerprint, and the crc32 of each block (the writer's goes into the metadata, every copy is compared)."""
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
    return {"tensors": plan, "fingerprint": fingerprint, "crcs": [_crc(b) for b, _, _ in plan.values()]}


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
    odd = [r for r, fp in enumerate(gathered) if fp != gathered[0]]
    if odd:
        raise CheckpointError(f"save_checkpoint needs the same tensor names, global shapes, dtypes, shardings and "
                              f"step on every rank; got rank(s) {odd} differing from rank 0", odd)


def _check_replicas(plan, mesh: Mesh, crcs: list) -> None:
    """Every rank's copy of a block must match the copy its writer stores: the others are not written, so a
    differing copy would be dropped without a word. Runs alike on every rank on every rank's gathered crcs
    (vectorized per distinct sharding: O(ranks) Python per sharding, not per tensor)."""
    table, problems, odd = np.array(crcs, dtype=np.int64).reshape(mesh.size, -1), [], set()
    names = list(plan["tensors"])
    for sharding, columns in _by_sharding(plan).items():
        writer = _writer_of(sharding, mesh)
        differs = table[:, columns] != table[writer][:, columns]  # [rank, tensor]
        for j in np.flatnonzero(differs.any(axis=0)):
            i = columns[j]
            for w in sorted({writer[r] for r in np.flatnonzero(differs[:, j])}):
                ranks = [r for r in range(mesh.size) if writer[r] == w]
                differ = [r for r in ranks if differs[r, j]]
                axes = tuple(a for a in mesh.axis_names if a not in sharding.axes)
                problems.append(f"{names[i]!r} block {list(sharding.block_index(mesh, w))} (replicated over {axes}) "
                                f"differs on rank(s) {differ} from rank {w}'s copy (crc32 {table[w, i]:08x}; ranks "
                                f"holding it: {ranks})")
                odd.update(differ)
    if problems:
        raise CheckpointError("save_checkpoint needs every copy of a replicated tensor to be bit-identical on the "
                              "ranks holding it (one copy is written, the others would be dropped); got "
                              + "; ".join(problems), sorted(odd))


def _by_sharding(plan) -> dict:
    """Sharding -> the plan's tensor positions that have it."""
    groups = {}
    for i, (_, _, sharding) in enumerate(plan["tensors"].values()):
        groups.setdefault(sharding, []).append(i)
    return groups


def _writer_of(sharding: Sharding, mesh: Mesh) -> list[int]:
    """Per rank: the rank that writes the block it holds (its replica with coordinate 0 off the sharding's axes)."""
    index = [sharding.block_index(mesh, r) for r in range(mesh.size)]
    writers = {index[r]: r for r in range(mesh.size) if _is_writer(sharding, mesh, r)}
    return [writers[i] for i in index]


def _new_files(plan, mesh: Mesh) -> list[str]:
    """Every file this save writes (its manifest): the blocks any rank writes, and the metadata."""
    stems = _file_names(plan["tensors"])
    blocks = [_block_file(stems[name], index) for name, (_, shape, sharding) in plan["tensors"].items()
              for index, _ in _all_blocks(shape, sharding, mesh)]
    return blocks + [METADATA]


@dataclass(frozen=True)
class _Staging:
    """Rank 0's record of a save in progress: its id, its ``<dir>.tmp-<id>`` and what it writes there, and the
    files of the checkpoint it replaces (None when there is none)."""
    save_id: str
    tmp: Path
    files: list
    old_files: list | None


def _stage(final: Path, plan, mesh: Mesh) -> _Staging:
    """Rank 0, before anything is written: check what the save would replace, then make its marked tmp dir."""
    files = _new_files(plan, mesh)
    old_files = _replaced_files(final, files)
    final.parent.mkdir(parents=True, exist_ok=True)
    save_id = uuid.uuid4().hex
    tmp = final.with_name(f"{final.name}.tmp-{save_id}")
    tmp.mkdir()
    try:
        _write_marker(tmp, save_id, files)
    except BaseException:
        tmp.rmdir()
        raise
    return _Staging(save_id, tmp, files, old_files)


def _replaced_files(final: Path, new_files: list) -> list | None:
    """The files of the checkpoint at ``final`` (its metadata's blocks and the metadata), [] for an empty
    directory, None for none; raises when ``final`` is something else or holds a user file the save would
    overwrite."""
    if not final.exists():
        return None
    if not final.is_dir() or not ((final / METADATA).is_file() or not any(final.iterdir())):
        # Replacing moves the old directory aside: only ever do that to a checkpoint.
        raise FileExistsError(f"save_checkpoint replaces only an earlier checkpoint (a directory with {METADATA}) "
                              f"or an empty directory; got {final}, which is neither")
    if not (final / METADATA).is_file():
        return []
    old = [METADATA] + [_plain_name(b.get("file"), name, final) for name, t in _read_metadata(final)["tensors"].items()
                        for b in t["blocks"]]
    clash = sorted((set(os.listdir(final)) - set(old) - {MARKER}) & set(new_files))
    if clash:
        raise FileExistsError(f"save_checkpoint keeps the files in {final} that its metadata does not list, so it "
                              f"must not write over them; got {clash} there, which the new checkpoint writes "
                              f"(move them)")
    return old


def _write_blocks(plan, mesh: Mesh, rank: int, where: Path) -> None:
    """Write this rank's blocks (those it is the writer of)."""
    stems = _file_names(plan["tensors"])
    for name, (block, shape, sharding) in plan["tensors"].items():
        if block.size and _is_writer(sharding, mesh, rank):
            _write_npy(where / _block_file(stems[name], sharding.block_index(mesh, rank)), block)


def _crc(block: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(block).view(np.uint8).reshape(-1))


def _publish(plan, mesh: Mesh, staging: _Staging, final: Path, step, crcs: list) -> None:
    """Rank 0: write the metadata (with each block's writer's checksum), then commit."""
    _write_json(staging.tmp / METADATA, _metadata(plan, mesh, _file_names(plan["tensors"]), step, crcs))
    _commit(staging, final)


def _metadata(plan, mesh: Mesh, stems, step, crcs: list) -> dict:
    crc_of = {}  # (tensor, block index) -> its writer's crc32
    for sharding, columns in _by_sharding(plan).items():
        writer = _writer_of(sharding, mesh)
        for w in set(writer):
            for i in columns:
                crc_of[i, sharding.block_index(mesh, w)] = crcs[w][i]
    tensors = {}
    for i, (name, (block, shape, sharding)) in enumerate(plan["tensors"].items()):
        blocks = []
        for index, bounds in _all_blocks(shape, sharding, mesh):
            blocks.append({"file": _block_file(stems[name], index), "offset": [a for a, _ in bounds],
                           "shape": [b - a for a, b in bounds], "crc32": crc_of[i, index]})
        tensors[name] = {"shape": list(shape), "dtype": _dtype_str(block.dtype), "sharding": sharding.to_json(),
                         "blocks": blocks}
    return {"format": FORMAT, "version": FORMAT_VERSION, "step": step, "mesh": mesh.to_json(), "tensors": tensors}


def _dtype_str(dtype: np.dtype) -> str:
    """The metadata's name of a dtype: its array-protocol string, but ``bfloat16`` by name (its string is a
    bare '<V2', which would load as raw bytes)."""
    return "bfloat16" if BFLOAT16 is not None and dtype == BFLOAT16 else dtype.str


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


def _commit(staging: _Staging, final: Path) -> None:
    """Rank 0: publish the tmp dir as ``final``; the old checkpoint survives until the new one is in place."""
    _fsync_dir(staging.tmp)  # the entries every rank created
    old = final.with_name(f"{final.name}.old-{staging.save_id}")
    if staging.old_files is not None:
        _write_marker(final, staging.save_id, staging.old_files)  # what a later save may delete, if we die
        os.rename(final, old)
    try:
        os.rename(staging.tmp, final)
    except Exception:
        if staging.old_files is not None:
            os.rename(old, final)
        raise
    _fsync_dir(final.parent)
    _tidy(final, lambda: _clean_up(staging, old, final))


def _clean_up(staging: _Staging, old: Path, final: Path) -> None:
    """After the commit: the replaced checkpoint, and leftovers of saves killed mid-way, go."""
    _unlink(final / MARKER)
    if staging.old_files is not None:
        _retire(old, staging.old_files, final)
    for stale, tag, files in _stale_saves(final):
        _retire(stale, files, final) if tag == "old" else _discard(stale, files)


def _tidy(final: Path, clean) -> None:
    """Run ``clean``; a failure to delete is warned about, not raised: the save's outcome is already decided
    (the new checkpoint in place, or the old one kept) and what is left is only ever this library's files."""
    try:
        clean()
    except OSError as e:
        warnings.warn(f"save_checkpoint could not clean up beside {final}: {type(e).__name__}: {e}", RuntimeWarning,
                      stacklevel=3)


# ------------------------------------------------------------------ what a save may delete

MARKER = ".spmd_checkpoint_save.json"


def _write_marker(directory: Path, save_id: str, files: list) -> None:
    """Mark ``directory`` as this library's, for save ``save_id``, listing the files a save may delete there."""
    _write_json(directory / MARKER, {"format": FORMAT, "save": save_id, "files": list(files)})


def _stale_saves(final: Path) -> list:
    """Siblings ``<final>.tmp-<id>`` / ``<final>.old-<id>`` that a save marked with that id: (path, tag, files)."""
    pattern = re.compile(re.escape(final.name) + r"\.(tmp|old)-([0-9a-f]{32})")
    found = []
    for entry in os.scandir(final.parent):
        match = pattern.fullmatch(entry.name)
        if match and entry.is_dir(follow_symlinks=False):
            files = _marked_files(Path(entry.path), match.group(2))
            if files is not None:
                found.append((Path(entry.path), match.group(1), files))
    return found


def _marked_files(directory: Path, save_id: str) -> list | None:
    """The files the marker in ``directory`` lists, if it is a marker of save ``save_id``; else None."""
    marker = directory / MARKER
    try:
        if not stat.S_ISREG(os.lstat(marker).st_mode):
            return None
        with open(marker) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    files = doc.get("files") if isinstance(doc, dict) else None
    if doc.get("format") != FORMAT or doc.get("save") != save_id or not isinstance(files, list):
        return None
    return [f for f in files if isinstance(f, str) and Path(f).name == f and f not in ("", ".", "..")]


def _retire(old: Path, files: list, final: Path) -> None:
    """Delete the replaced checkpoint ``old``: everything in it but ``files`` (the user's) first moves into
    ``final`` (unless ``final`` has that name already: it then stays, and so does ``old``)."""
    keep = set(files) | {MARKER}
    for entry in os.listdir(old):
        if entry not in keep and not os.path.lexists(final / entry):
            os.rename(old / entry, final / entry)
    _discard(old, files)


def _discard(directory: Path, files: list) -> None:
    """Delete ``files`` and the marker in ``directory``, then the directory if that emptied it."""
    for name in list(files) + [MARKER]:
        _unlink(directory / name)
    try:
        os.rmdir(directory)
    except OSError:  # something not ours is left in it: it stays
        pass


def _unlink(path: Path) -> None:
    """Remove a file or symlink (never what it points at, never a directory); nothing if there is none."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass


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
    each; ``strict=False`` loads only the tensors that match. Before any block
    is read, each tensor's blocks must tile its shape exactly once (no overlap,
    no gap) and, with ``verify`` (default True; ``verify=False`` or
    ``SPMD_CHECKPOINT_VERIFY=0`` turns it off), each must carry a crc32, which
    every block read is checked against. ``checkpoint.json`` and block files
    that are symlinks or hard links are refused. Each rank memory-maps only the
    stored blocks that overlap its own block. ``views``: name -> ``StackOf`` / ``SliceOf``, how to read a tensor the checkpoint stores in
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
    for name, entry in meta["tensors"].items():
        _check_blocks(path, name, entry, verify)
    stored = _matching(_with_views(meta["tensors"], views or {}, path), _expected(shardings, expect),
                       set(expect or ()), expect is not None, strict, path)
    specs = _load_specs(shardings, mesh, stored)
    # strict=False: a sharding for a stored tensor or a view that did not match (or whose sources are not all
    # stored: TrainStep.load of a checkpoint holding parameters alone) just goes unused
    unknown = sorted(set(specs) - set(stored) - (set(meta["tensors"]) | set(views or ()) if not strict else set()))
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
    # np.empty is safe: _check_blocks made sure the stored blocks tile the tensor, so every element is written.
    out = np.empty([b - a for a, b in mine], dtype=np.dtype(entry["dtype"]))
    for blk in entry["blocks"]:
        part = [(max(a, o), min(b, o + s)) for (a, b), o, s in zip(mine, blk["offset"], blk["shape"])]
        if any(hi <= lo for lo, hi in part):
            continue
        data = _open_block(path, name, blk, out.dtype, verify)
        src = tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(part, blk["offset"]))
        out[tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(part, mine))] = data[src]
    return out


def _open_block(path: Path, name: str, blk: dict, dtype, verify: bool) -> np.ndarray:
    file = blk["file"]
    _check_regular(path / file, "a block file", f"{file} of {name!r}")
    try:
        data = load_npy(path / file, mmap_mode="r")
    except (ValueError, OSError, EOFError) as e:
        raise ValueError(f"block file {file} of {name!r} must be a readable .npy file; got {type(e).__name__}: "
                         f"{e} in {path} (corrupt header or truncated)") from None
    if data.dtype.kind == "V" and dtype == BFLOAT16 and data.dtype.itemsize == 2:  # .npy keeps bfloat16 as '|V2'
        data = data.view(dtype)
    if list(data.shape) != list(blk["shape"]) or data.dtype != dtype:
        raise ValueError(f"block file {file} of {name!r} must hold {np.dtype(dtype).name}{list(blk['shape'])}; got "
                         f"{data.dtype.name}{list(data.shape)} in {path} (corrupt or replaced)")
    if verify and _crc(data) != blk["crc32"]:
        raise ValueError(f"block file {file} of {name!r} must match its crc32 {blk['crc32']:08x} in {METADATA}; got "
                         f"{_crc(data):08x} in {path} (corrupt; SPMD_CHECKPOINT_VERIFY=0 skips this check)")
    return data


# ------------------------------------------------------------------ what a load trusts

def _check_regular(path: Path, kind: str, what: str) -> None:
    """A file a checkpoint reads must be its own: a regular file (a symlink may point anywhere) with a single
    link (a hard link's other name may be anywhere: writing there changes the checkpoint)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{kind} listed in a checkpoint must exist; got no {what} in {path.parent}") from None
    if stat.S_ISLNK(st.st_mode):
        raise ValueError(f"{kind} must be a regular file, not a symlink; got {what} -> {os.readlink(path)} in "
                         f"{path.parent}")
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{kind} must be a regular file; got {what}, which is not, in {path.parent}")
    if st.st_nlink != 1:
        raise ValueError(f"{kind} must have a single link, not be a hard link (copy the file in instead); got {what} "
                         f"with {st.st_nlink} links in {path.parent}")


def _plain_name(file, name: str, path: Path) -> str:
    """A block's file name, which must not point outside the checkpoint."""
    if not isinstance(file, str) or Path(file).name != file or file in ("", ".", ".."):
        raise ValueError(f"a block file of {name!r} must be a plain file name; got {file!r} in {path}")
    return file


def _is_count(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def _check_blocks(path: Path, name: str, entry: dict, verify: bool) -> None:
    """Before any block is read: ``entry``'s blocks are well formed, carry their crc32 (with ``verify``) and tile
    the tensor exactly once, so every element loaded comes from exactly one block (never np.empty's garbage).
    Cost per tensor of B blocks: O(B) Python and an O(B^2) vectorized overlap test, once per load."""
    shape, blocks = entry.get("shape"), entry.get("blocks")
    if not isinstance(shape, list) or not all(_is_count(n) for n in shape) or not isinstance(blocks, list):
        raise ValueError(f"tensor {name!r} needs a shape (a list of sizes) and a list of blocks in {METADATA}; got "
                         f"shape {shape!r} and blocks of type {type(blocks).__name__} in {path}")
    files, lo, hi = [], [], []
    for blk in blocks:
        file = _plain_name(blk.get("file") if isinstance(blk, dict) else None, name, path)
        offset, size = blk.get("offset"), blk.get("shape")
        if not all(isinstance(v, list) and len(v) == len(shape) and all(map(_is_count, v)) for v in (offset, size)):
            raise ValueError(f"block {file} of {name!r} needs an offset and a shape of {len(shape)} sizes each; got "
                             f"offset {offset!r} and shape {size!r} in {path / METADATA}")
        crc = blk.get("crc32")
        if verify and not (_is_count(crc) and crc < 1 << 32):
            raise ValueError(f"every block needs its crc32 in {METADATA} to be verified (verify=False or "
                             f"SPMD_CHECKPOINT_VERIFY=0 loads unverified); got "
                             f"{'none' if 'crc32' not in blk else repr(crc)} for block file {file} of {name!r} in {path}")
        end = [o + s for o, s in zip(offset, size)]
        if any(s == 0 or e > n for s, e, n in zip(size, end, shape)):
            raise ValueError(f"each block of {name!r} must be non-empty and lie inside its shape {shape}; got block "
                             f"{file} at {_region(offset, end)} in {path / METADATA}")
        files.append(file), lo.append(offset), hi.append(end)
    _check_tiling(path, name, shape, files, np.array(lo, np.int64).reshape(len(files), len(shape)),
                  np.array(hi, np.int64).reshape(len(files), len(shape)))


def _check_tiling(path: Path, name: str, shape: list, files: list, lo: np.ndarray, hi: np.ndarray) -> None:
    """No two blocks (rows of [lo, hi) boxes) overlap and their volumes add up to the tensor's: an exact tiling."""
    rule = f"the blocks of {name!r} must tile its shape {shape} exactly once"
    for start in range(0, len(files), 256):  # rows in chunks: memory 256 x B x ndim
        rows = slice(start, start + 256)
        overlap = np.all((lo[rows, None] < hi[None]) & (lo[None] < hi[rows, None]), axis=-1)  # [i, j]
        overlap &= np.arange(start, start + len(overlap))[:, None] < np.arange(len(files))[None]  # pairs j > i
        if overlap.any():
            i, j = np.argwhere(overlap)[0]
            i += start
            raise ValueError(f"{rule}; got blocks {files[i]} and {files[j]} both covering "
                             f"{_region(np.maximum(lo[i], lo[j]), np.minimum(hi[i], hi[j]))} in {path / METADATA}")
    covered, total = int(np.prod(hi - lo, axis=1).sum()), math.prod(shape)
    if covered != total:
        raise ValueError(f"{rule}; got {_gap(shape, lo, hi)} covered by no block ({total - covered} of {total} "
                         f"elements missing) in {path / METADATA}")


def _gap(shape: list, lo: np.ndarray, hi: np.ndarray) -> str:
    """One region no block covers (a cell of the grid the blocks' edges cut), for the error message."""
    cuts = [np.unique(np.concatenate([[0, n], lo[:, d], hi[:, d]])) for d, n in enumerate(shape)]
    if math.prod(len(c) - 1 for c in cuts) > 1 << 22:  # a pathological grid: say only how much is missing
        return "a region"
    covered = np.zeros([len(c) - 1 for c in cuts], bool)
    for a, b in zip(lo, hi):
        covered[tuple(slice(np.searchsorted(c, x), np.searchsorted(c, y)) for c, x, y in zip(cuts, a, b))] = True
    cell = np.argwhere(~covered)[0]
    return _region([c[k] for c, k in zip(cuts, cell)], [c[k + 1] for c, k in zip(cuts, cell)])


def _region(lo, hi) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in zip(lo, hi)) + "]" if len(lo) else "the scalar"


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
    _check_regular(path / METADATA, f"a checkpoint's {METADATA}", METADATA)
    with open(path / METADATA) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
        raise ValueError(f"a checkpoint has format {FORMAT} version {FORMAT_VERSION}; got {meta.get('format')!r} "
                         f"version {meta.get('version')!r} in {path / METADATA}")
    return meta


__all__ = ["save_checkpoint", "load_checkpoint", "checkpoint_info", "CheckpointError", "local_block_slices", "StackOf",
           "SliceOf"]
