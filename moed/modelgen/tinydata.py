"""The tiny trained MoE's data: a byte-level vocabulary and the standard library's source.

Torch-free (the tests and the engines' checks use it; moed.modelgen.train trains on it).

Invariants:
- The vocabulary is makemodel's byte-fallback vocabulary cut after its first piece:
  `<unk> <s> </s>`, the 256 byte tokens `<0xXX>` (id 3 + byte) and `\u2581` (id 259).
  With `add_space_prefix` off, llama.cpp's SentencePiece tokenizer turns every space
  into `\u2581` and every other byte into its byte token, so `encode` is llama.cpp's
  tokenization of UTF-8 text (checked by moed.modelgen.train.check_tokenizer and the e2e tests).
- The held-out split is by file, one in `every` by a hash of the path under the
  stdlib directory, so it is the same on every machine with the same Python.
"""

from __future__ import annotations

import hashlib
import pathlib
import sysconfig

import numpy as np

from moed.modelgen import makemodel

SPACE_ID = 259
VOCAB = 260
BOS = 1


def vocab() -> tuple[list[str], list[float], list[int]]:
    """makemodel's byte-fallback vocabulary, specials + bytes + the space piece only."""
    tokens, scores, types = makemodel.build_vocab()
    assert tokens[SPACE_ID] == "\u2581" and tokens[3] == "<0x00>"
    return tokens[:VOCAB], scores[:VOCAB], types[:VOCAB]


def encode(data: bytes) -> np.ndarray:
    """Token ids of `data` as llama.cpp tokenizes it (no BOS)."""
    ids = np.frombuffer(data, np.uint8).astype(np.uint16) + 3
    ids[ids == 0x20 + 3] = SPACE_ID
    return ids


def decode(ids) -> bytes:
    out = bytearray()
    for t in ids:
        t = int(t)
        if t == SPACE_ID:
            out.append(0x20)
        elif 3 <= t < 259:
            out.append(t - 3)
    return bytes(out)


def stdlib_files() -> list[pathlib.Path]:
    """The standard library's .py files, without its test suites, sorted."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts[:-1]))


def held_out(path: pathlib.Path, every: int) -> bool:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    rel = path.relative_to(root).as_posix().encode()
    return int.from_bytes(hashlib.sha1(rel).digest()[:4], "little") % every == 0


def corpus(every: int = 20) -> tuple[np.ndarray, np.ndarray, dict]:
    """(train ids, held-out ids, info): each file as BOS + its bytes, concatenated."""
    parts: dict[bool, list[np.ndarray]] = {False: [], True: []}
    counts = {False: 0, True: 0}
    for p in stdlib_files():
        data = p.read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        h = held_out(p, every)
        parts[h] += [np.array([BOS], np.uint16), encode(data)]
        counts[h] += 1
    train, test = (np.concatenate(parts[k]) for k in (False, True))
    return (
        train,
        test,
        {
            "train_files": counts[False],
            "heldout_files": counts[True],
            "train_tokens": int(train.size),
            "heldout_tokens": int(test.size),
        },
    )


def eval_windows(ids: np.ndarray, ctx: int, n: int, seed: int = 1) -> np.ndarray:
    """`n` fixed windows of `ctx` tokens from `ids` (the held-out split)."""
    rng = np.random.default_rng(seed)
    starts = np.sort(rng.choice(ids.size - ctx - 1, size=n, replace=False))
    return np.stack([ids[s : s + ctx] for s in starts]).astype(np.int64)
