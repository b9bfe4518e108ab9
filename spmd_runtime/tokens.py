"""Token files in nanoGPT's format and a loader that reads each rank's own block of every batch.

A token file is a flat array of token ids, raw, no header (``train.bin`` / ``val.bin``, written by
``ids.tofile(path)``): uint16 when the vocabulary has at most 65536 ids, uint32 above (nanoGPT's
``prepare.py``). An optional ``meta.json`` beside it (``write_meta``, ``prepare_corpus``) records
``vocab_size`` and ``dtype``; the loader checks them against its own.

``TokenLoader`` draws the global batch of position ``i`` from ``(seed, i)`` alone: with ``shuffle`` (training)
the rows are windows of ``seq + 1`` tokens at offsets drawn uniformly, as nanoGPT's ``get_batch``; without it
(evaluation) they are consecutive windows from the start of the file, wrapping around. Each rank passes the
slices of the batch it holds (``rows``, ``cols``: ``TrainStep.batch_block(rank)``) and memory-maps the file:
it reads exactly the tokens of its own block, never the whole file, and gets the same global batches for a
seed whatever the number of ranks. ``position`` (batches drawn so far) is its whole state
(``state_dict`` / ``load_state_dict``), saved with checkpoints so a resumed run draws the same batches.
"""
from __future__ import annotations

import json
import os

import numpy as np

from . import data

META = "meta.json"


def token_dtype(vocab: int) -> np.dtype:
    """nanoGPT's file dtype for a vocabulary of ``vocab`` ids: uint16 up to 65536 ids, uint32 above."""
    if not isinstance(vocab, (int, np.integer)) or vocab < 1:
        raise ValueError(f"vocab must be a positive int; got {vocab!r}")
    return np.dtype(np.uint16 if vocab <= 2 ** 16 else np.uint32)


def write_tokens(path, ids, vocab: int) -> None:
    """Write ``ids`` as a token file for a vocabulary of ``vocab`` ids (its ``token_dtype``)."""
    ids = np.asarray(ids)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"write_tokens takes a 1-d array of integer ids; got {ids.dtype}{list(ids.shape)}")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError(f"write_tokens ids must lie in [0, vocab={vocab}); got ids in [{ids.min()}, {ids.max()}]")
    ids.astype(token_dtype(vocab)).tofile(path)


def write_meta(directory, vocab: int, **extra) -> None:
    """``meta.json`` of the token files in ``directory``: ``vocab_size``, ``dtype`` and ``extra`` (JSON values)."""
    with open(os.path.join(directory, META), "w") as f:
        json.dump({"vocab_size": int(vocab), "dtype": token_dtype(vocab).name, **extra}, f, indent=1)


def read_meta(directory) -> dict | None:
    """The ``meta.json`` beside the token files in ``directory``, or None where there is none."""
    path = os.path.join(directory, META)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def prepare_corpus(directory, sentences: int = 2000, seed: int = 0, val_fraction: float = 0.1) -> dict:
    """``train.bin``, ``val.bin`` and ``meta.json`` in ``directory`` from the bundled corpus (``data.corpus``,
    character tokens): the first ``1 - val_fraction`` of the text trains, the rest evaluates, as nanoGPT's
    ``shakespeare_char/prepare.py`` splits. Nothing is downloaded. Returns the meta (``vocab_size`` is
    ``len(ALPHABET)``; ``alphabet`` decodes ids)."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"prepare_corpus val_fraction must lie in (0, 1); got {val_fraction!r}")
    os.makedirs(directory, exist_ok=True)
    ids = data.encode(data.corpus(sentences, seed))
    cut = int(len(ids) * (1.0 - val_fraction))
    vocab = len(data.ALPHABET)
    write_tokens(os.path.join(directory, "train.bin"), ids[:cut], vocab)
    write_tokens(os.path.join(directory, "val.bin"), ids[cut:], vocab)
    write_meta(directory, vocab, alphabet=data.ALPHABET, train_tokens=cut, val_tokens=len(ids) - cut)
    return read_meta(directory)


class TokenLoader:
    """Batches of ``(tokens, labels)``, each ``(batch, seq)`` globally, labels the next tokens; this rank gets
    its block ``[rows, cols]`` of both (int32). ``vocab``: the model's vocabulary (ids at or above it fail, and
    the file's dtype follows from it unless ``dtype`` is given; a ``meta.json`` beside the file must agree).
    Iterating draws the batch at ``position`` and advances it."""

    def __init__(self, path, batch: int, seq: int, vocab: int, *, seed: int = 0, shuffle: bool = True,
                 rows: slice = slice(None), cols: slice = slice(None), dtype=None, position: int = 0):
        for name, value in (("batch", batch), ("seq", seq)):
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"TokenLoader {name} must be a positive int; got {value!r}")
        self.path, self.batch, self.seq, self.vocab = str(path), int(batch), int(seq), int(vocab)
        self.seed, self.shuffle, self.position = int(seed), bool(shuffle), int(position)
        self.dtype = np.dtype(dtype) if dtype is not None else token_dtype(vocab)
        if self.dtype not in (np.dtype(np.uint16), np.dtype(np.uint32)):
            raise ValueError(f"TokenLoader dtype must be uint16 or uint32 (nanoGPT's token files); got {self.dtype}")
        self._check_meta()
        size = os.path.getsize(self.path)
        if size % self.dtype.itemsize:
            raise ValueError(f"token file {self.path} must hold whole {self.dtype} ids; got {size} bytes, not a "
                             f"multiple of {self.dtype.itemsize} (is it a file of another dtype?)")
        self.tokens = size // self.dtype.itemsize
        if self.tokens < self.seq + 1:
            raise ValueError(f"token file {self.path} must hold at least seq + 1 = {self.seq + 1} tokens; got "
                             f"{self.tokens}")
        self.rows = range(self.batch)[rows]
        self.cols = range(self.seq)[cols]
        if self.rows.step != 1 or self.cols.step != 1:
            raise ValueError(f"TokenLoader rows and cols must be contiguous slices; got rows={rows}, cols={cols}")
        self._data = np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.tokens,))

    def _check_meta(self) -> None:
        meta = read_meta(os.path.dirname(os.path.abspath(self.path)))
        if meta is None:
            return
        if meta.get("dtype") not in (None, self.dtype.name):
            raise ValueError(f"token file {self.path}: its meta.json says dtype {meta['dtype']}; got dtype "
                             f"{self.dtype.name} (from vocab={self.vocab})")
        if int(meta.get("vocab_size", 0)) > self.vocab:
            raise ValueError(f"token file {self.path}: its meta.json says vocab_size {meta['vocab_size']}, more ids "
                             f"than the model's vocab={self.vocab}; use a model with vocab >= {meta['vocab_size']}")

    def starts(self, position: int) -> np.ndarray:
        """The first token of every row (the whole batch's, int64) of the batch at ``position``."""
        windows = self.tokens - self.seq  # offsets whose seq + 1 tokens fit, as nanoGPT's get_batch
        if self.shuffle:
            return np.random.default_rng([self.seed, position]).integers(0, windows, size=self.batch)
        first = position * self.batch * self.seq
        return (first + self.seq * np.arange(self.batch, dtype=np.int64)) % windows

    def batch_at(self, position: int) -> tuple[np.ndarray, np.ndarray]:
        """This rank's block of the batch at ``position``: (tokens, labels), int32, read from the file (only
        those tokens: a memory-mapped fancy index)."""
        starts = self.starts(position)[self.rows.start:self.rows.stop]
        offsets = np.arange(self.cols.start, self.cols.stop + 1, dtype=np.int64)
        window = np.asarray(self._data[starts[:, None] + offsets[None, :]])
        if window.size and int(window.max()) >= self.vocab:  # checked before the int32 cast, which could wrap
            row, col = np.unravel_index(int(np.argmax(window >= self.vocab)), window.shape)
            raise ValueError(f"token file {self.path} must hold ids below the model's vocab={self.vocab}; got id "
                             f"{int(window[row, col])} at token {int(starts[row] + offsets[col])} (a file for a "
                             f"larger vocabulary, or of another dtype?)")
        window = window.astype(np.int32)
        return window[:, :-1], window[:, 1:]

    def __iter__(self):
        return self

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        out = self.batch_at(self.position)
        self.position += 1
        return out

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if int(state["seed"]) != self.seed:
            raise ValueError(f"TokenLoader state of seed {state['seed']} loaded into a loader of seed {self.seed}; "
                             f"make the loader with seed={state['seed']}")
        self.position = int(state["position"])

    def __repr__(self):
        return (f"TokenLoader({os.path.basename(self.path)}: {self.tokens} {self.dtype} tokens, batch {self.batch} x "
                f"seq {self.seq}, rows {self.rows.start}:{self.rows.stop}, cols {self.cols.start}:{self.cols.stop}, "
                f"{'shuffled' if self.shuffle else 'in order'}, seed {self.seed}, position {self.position})")


__all__ = ["TokenLoader", "prepare_corpus", "write_tokens", "write_meta", "read_meta", "token_dtype"]
