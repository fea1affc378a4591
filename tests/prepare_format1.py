"""A writer of format-1 datasets, as data/prepare.py wrote them before format 2 (git 9d57ac2), so
that tests/test_data.py can check that such datasets are read and reused as they are.

Format 1 (docs/data.md): each split's token stream cut into ``{split}_{index:06d}.bin`` shards of
``shard_tokens`` tokens, and a ``manifest.json`` listing them. The streams come from today's
library functions (the same documents, tokenizer and validation rule); what is written here is
only the format-1 container, byte for byte as the old preparation wrote it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from data import prepare as prep
from data.tokenizer import Tokenizer, train_tokenizer

FORMAT_VERSION = 1
DEFAULT_SHARD_TOKENS = 100_000_000


def _streams(tokenizer: Tokenizer, documents: list[str], val_fraction: float,
             max_tokens: int | None) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Each split's token stream (every document followed by EOS) and its document count; up to
    the document that brings the total (both splits) to ``max_tokens``."""
    if not documents:
        raise ValueError("the corpus is empty")
    flat, lengths = prep._encode_docs(tokenizer, documents)
    ends = np.cumsum(lengths)
    if max_tokens is not None and ends[-1] >= max_tokens:
        keep = int(np.searchsorted(ends, max_tokens)) + 1
        lengths, flat = lengths[:keep], flat[: int(ends[keep - 1])]
    is_val = prep.val_mask(np.arange(len(lengths)), val_fraction)
    token_is_val = np.repeat(is_val, lengths)
    streams = {"train": flat[~token_is_val], "val": flat[token_is_val]}
    return streams, {"train": int((~is_val).sum()), "val": int(is_val.sum())}


def _write_shards(out: Path, split: str, stream: np.ndarray, shard_tokens: int) -> list[dict[str, Any]]:
    shards = []
    for index, start in enumerate(range(0, len(stream), shard_tokens)):
        blob = stream[start : start + shard_tokens].tobytes()
        name = f"{split}_{index:06d}.bin"
        (out / name).write_bytes(blob)
        shards.append({"file": name, "tokens": len(blob) // stream.itemsize,
                       "sha256": hashlib.sha256(blob).hexdigest()})
    return shards


def prepare(out_dir: str | os.PathLike, tokenizer_path: str | os.PathLike,
            inputs: Sequence[str | os.PathLike] = (), *, hf_dataset: Mapping[str, Any] | None = None,
            text_field: str = "text", val_fraction: float = 0.01, max_tokens: int | None = None,
            shard_tokens: int = DEFAULT_SHARD_TOKENS, num_workers: int | None = None,
            progress: bool = True) -> Path:
    """The format-1 dataset of ``inputs`` in ``out_dir`` (created, or holding only a tokenizer);
    the arguments are today's `data.prepare.prepare`'s, ``shard_tokens`` format 1's own.
    ``num_workers`` and ``progress`` change nothing in the output, so they are ignored."""
    files = prep.expand_inputs(inputs)
    tokenizer = Tokenizer(tokenizer_path)
    recipe = {
        "sources": prep._source_ids(files, hf_dataset),
        "text_field": text_field,
        "tokenizer_sha256": tokenizer.sha256,
        "val_fraction": val_fraction,
        "max_tokens": max_tokens,
        "shard_tokens": shard_tokens,
        "format_version": FORMAT_VERSION,
    }
    out = Path(out_dir).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / ".lock").touch()  # format 1's preparation left its (empty) lock file
    documents = list(prep._documents(files, hf_dataset, text_field))
    streams, counts = _streams(tokenizer, documents, val_fraction, max_tokens)
    fingerprint = hashlib.sha256(tokenizer.sha256.encode())
    splits = {}
    for split, stream in streams.items():
        shards = _write_shards(out, split, stream, shard_tokens)
        splits[split] = {"documents": counts[split], "tokens": len(stream), "shards": shards}
        fingerprint.update(f" {split}:{hashlib.sha256(stream.tobytes()).hexdigest()}".encode())
    if not splits["train"]["shards"]:
        raise ValueError("the train split is empty")
    manifest = {
        "format_version": FORMAT_VERSION,
        "dtype": prep.token_dtype(tokenizer.vocab_size).name,
        "vocab_size": tokenizer.vocab_size,
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
        "tokenizer": {"path": str(tokenizer.path), "sha256": tokenizer.sha256},
        "splits": splits,
        "fingerprint": fingerprint.hexdigest(),
        "recipe_id": prep._digest(recipe),
        "recipe": recipe,
    }
    (out / prep.MANIFEST).write_text(json.dumps(manifest, indent=2))
    return out


def prepare_from_config(cfg: Mapping[str, Any]) -> Path:
    """Format 1's `data.prepare.prepare_from_config`: the dataset of the ``data`` config group
    ``cfg`` in the cache directory that format 1 named, ``{cache_dir}/{name}-{key[:12]}``; a
    tokenizer trained there on the train split when ``tokenizer_path`` is null."""
    hf_dataset = dict(cfg["hf_dataset"]) if cfg.get("hf_dataset") else None
    files = prep.expand_inputs(prep._repo_path(p) for p in (cfg.get("inputs") or []))
    text_field = cfg.get("text_field") or "text"
    vocab_size, val_fraction = int(cfg["vocab_size"]), float(cfg["val_fraction"])
    given = Tokenizer(prep._repo_path(cfg["tokenizer_path"])) if cfg.get("tokenizer_path") else None
    key = prep._digest({
        "sources": prep._source_ids(files, hf_dataset),
        "tokenizer": given.sha256 if given else {"train_bpe": vocab_size},
        "text_field": text_field,
        "val_fraction": val_fraction,
        "max_tokens": cfg.get("max_tokens"),
        "format_version": FORMAT_VERSION,
    })
    out = prep._repo_path(cfg["cache_dir"]) / f"{cfg['name']}-{key[:12]}"
    if given is None:
        documents = prep._train_documents(files, hf_dataset, text_field, val_fraction)
        given = train_tokenizer(documents, out / "tokenizer.model", vocab_size)
    return prepare(out, given.path, files, hf_dataset=hf_dataset, text_field=text_field,
                   val_fraction=val_fraction, max_tokens=cfg.get("max_tokens"))
