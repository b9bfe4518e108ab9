"""A small bundled corpus and a batch iterator for the training demo and tests; nothing is downloaded.

The corpus is the opening paragraph of Dickens' "A Tale of Two Cities" (1859, public
domain) followed by sentences from a tiny fixed grammar drawn from a seeded generator,
so it is identical on every machine and has structure a small model learns quickly.
Tokens are characters: ``ALPHABET`` lists every character the corpus uses, in a fixed
order, and a character's token is its position there (so any ``vocab >= len(ALPHABET)``
fits; larger vocabularies simply leave ids unused).
"""
from __future__ import annotations

import numpy as np

DICKENS = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, "
    "it was the season of Darkness, it was the spring of hope, it was the winter of despair, we had "
    "everything before us, we had nothing before us, we were all going direct to Heaven, we were all going "
    "direct the other way--in short, the period was so far like the present period, that some of its "
    "noisiest authorities insisted on its being received, for good or for evil, in the superlative degree "
    "of comparison only.\n")

GRAMMAR = {
    "S": [["NP", "VP", "."], ["NP", "VP", "and", "NP", "VP", "."], ["when", "NP", "VP", ",", "NP", "VP", "."]],
    "NP": [["the", "N"], ["the", "ADJ", "N"], ["a", "ADJ", "N"], ["every", "N"]],
    "VP": [["VT", "NP"], ["VT", "NP", "in", "the", "PLACE"], ["VI"], ["VI", "in", "the", "PLACE"]],
    "N": [["cat"], ["dog"], ["clerk"], ["banker"], ["child"], ["coach"], ["lamp"], ["road"], ["tailor"]],
    "ADJ": [["grey"], ["quiet"], ["red"], ["small"], ["weary"], ["bright"]],
    "VT": [["sees"], ["follows"], ["finds"], ["watches"], ["carries"]],
    "VI": [["waits"], ["sleeps"], ["sings"]],
    "PLACE": [["street"], ["city"], ["garden"], ["tavern"], ["fog"]],
}

ALPHABET = "\n !\"',-.:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def grammar_text(sentences: int, seed: int = 0) -> str:
    """``sentences`` sentences of ``GRAMMAR``, drawn from ``seed`` (one paragraph per 8 sentences)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(sentences):
        words = _expand("S", rng)
        text = " ".join(words).replace(" .", ".").replace(" ,", ",")
        out.append(text[0].upper() + text[1:] + ("\n" if i % 8 == 7 else " "))
    return "".join(out)


def _expand(symbol: str, rng) -> list[str]:
    if symbol not in GRAMMAR:
        return [symbol]
    choice = GRAMMAR[symbol][rng.integers(len(GRAMMAR[symbol]))]
    return [w for part in choice for w in _expand(part, rng)]


def corpus(sentences: int = 2000, seed: int = 0) -> str:
    """The bundled text: the Dickens paragraph, then ``sentences`` grammar sentences."""
    return DICKENS + grammar_text(sentences, seed)


def encode(text: str) -> np.ndarray:
    """int32 token ids of ``text`` (positions in ``ALPHABET``)."""
    index = {c: i for i, c in enumerate(ALPHABET)}
    unknown = sorted(set(text) - set(index))
    if unknown:
        raise ValueError(f"encode takes characters of ALPHABET; got {unknown}")
    return np.fromiter((index[c] for c in text), dtype=np.int32, count=len(text))


def decode(ids) -> str:
    return "".join(ALPHABET[int(i)] for i in ids)


def batches(tokens: np.ndarray, batch: int, seq: int, seed: int = 0):
    """Endless (tokens, labels) pairs of shape (batch, seq): windows at offsets drawn from ``seed``,
    labels the next characters. Every rank drawing with the same seed gets the same batches."""
    tokens = np.asarray(tokens, dtype=np.int32)
    if len(tokens) < seq + 1:
        raise ValueError(f"batches need a corpus longer than seq; got {len(tokens)} tokens for seq={seq}")
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(tokens) - seq, size=batch)
        window = np.stack([tokens[s:s + seq + 1] for s in starts])
        yield window[:, :-1], window[:, 1:]


__all__ = ["ALPHABET", "DICKENS", "corpus", "encode", "decode", "batches", "grammar_text"]
