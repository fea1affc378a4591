"""Format 1 of data/prepare.py: the preparation that wrote format-1 datasets, unchanged, so that
tests/test_data.py can make such datasets and check that they are read and reused as they are.

Tokenize a corpus into token shards with a train/validation split.

Inputs are files, directories of files, or a streamed Hugging Face dataset:

- ``.txt``: documents are separated by blank lines (lines holding only whitespace count as blank);
- ``.jsonl``: one JSON object per line, the document in a string field (``text`` by default);
- ``.parquet``: the document in a string column (``text`` by default);
- ``.txt`` and ``.jsonl`` may be compressed: ``.gz``, ``.xz`` or ``.zst``;
- a directory stands for every such file below it, in sorted path order.

Documents made only of whitespace are skipped. Document ``i`` (counting from 0 over all inputs)
goes to the validation split when `val_mask` says so: an evenly spread ``val_fraction`` of them.

The output directory holds ``train_000000.bin``, ``train_000001.bin``, ... and ``val_000000.bin``,
...: raw little-endian token ids (``uint16`` when the vocabulary has at most 65,536 pieces, else
``uint32``), every document followed by EOS, the shards of a split forming one continuous stream.
``manifest.json`` is written last, by an atomic rename, so its presence marks a complete dataset.
See docs/data.md for the manifest's fields.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gzip
import hashlib
import json
import lzma
import multiprocessing
import os
import sys
from collections import deque
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import IO, Any

import numpy as np
from tqdm import tqdm

from data.tokenizer import Tokenizer, train_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]
MANIFEST = "manifest.json"
FORMAT_VERSION = 1
DEFAULT_SHARD_TOKENS = 100_000_000
# Names prepare() may find in an output directory that holds no dataset yet: its lock file, its
# marker of an unfinished run, and a tokenizer trained into the directory (never written here).
_OWN_NAMES = {".lock", ".incomplete", "tokenizer.model"}
_CHUNK_CHARS = 1 << 18  # characters of text per unit of work sent to a worker
_TOKENIZER_TRAIN_CHARS = 200_000_000  # a trained tokenizer sees at most this much text


# ----------------------------------------------------------------------------- reading documents


def _kind(path: Path) -> str | None:
    """``txt``, ``jsonl`` or ``parquet`` for a readable input file name, else None."""
    suffixes = path.suffixes[-2:]
    if suffixes and suffixes[-1] in (".gz", ".xz", ".zst"):
        return suffixes[0][1:] if suffixes[0] in (".txt", ".jsonl") and len(suffixes) == 2 else None
    return suffixes[-1][1:] if suffixes and suffixes[-1] in (".txt", ".jsonl", ".parquet") else None


def _open_text(path: Path) -> IO[str]:
    """Open a possibly compressed text file for reading as UTF-8."""
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    if path.suffix == ".xz":
        return lzma.open(path, "rt", encoding="utf-8")
    if path.suffix == ".zst":
        try:
            import zstandard
        except ImportError as err:
            raise ImportError(f"reading {path} needs zstandard: pip install zstandard") from err
        return zstandard.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def expand_inputs(inputs: Iterable[str | os.PathLike]) -> list[Path]:
    """Resolve input paths to the list of readable files; directories expand to their files."""
    files: list[Path] = []
    for item in inputs:
        path = Path(item).expanduser().resolve()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and _kind(p))
            if not found:
                raise FileNotFoundError(
                    f"input directory {path} holds no .txt, .jsonl or .parquet files "
                    "(optionally .gz/.xz/.zst). Point the input at the files to tokenize."
                )
            files.extend(found)
        elif path.is_file():
            if _kind(path) is None:
                raise ValueError(
                    f"unsupported input file {path}: use .txt, .jsonl or .parquet "
                    "(.txt and .jsonl may end in .gz, .xz or .zst)."
                )
            files.append(path)
        else:
            raise FileNotFoundError(f"input not found: {path}. Check the path (and its spelling).")
    return files


def _txt_documents(path: Path) -> Iterator[str]:
    lines: list[str] = []
    with _open_text(path) as fh:
        for line in fh:
            line = line.rstrip("\n")
            if line.strip():
                lines.append(line)
            elif lines:
                yield "\n".join(lines)
                lines = []
    if lines:
        yield "\n".join(lines)


def _jsonl_documents(path: Path, text_field: str) -> Iterator[str]:
    with _open_text(path) as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line).get(text_field)
            except (json.JSONDecodeError, AttributeError) as err:
                raise ValueError(f"{path}:{number} is not a JSON object ({err}).") from err
            if not isinstance(text, str):
                raise ValueError(
                    f"{path}:{number} has no string field {text_field!r}. Set the text field "
                    "(data.text_field / --text-field) to the field holding the document."
                )
            yield text


def _parquet_documents(path: Path, text_field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    table = pq.ParquetFile(path)
    if text_field not in table.schema_arrow.names:
        raise ValueError(
            f"{path} has no column {text_field!r} (columns: {table.schema_arrow.names}). Set the "
            "text field (data.text_field / --text-field) to the column holding the documents."
        )
    for batch in table.iter_batches(columns=[text_field], batch_size=1024):
        yield from (text for text in batch.column(0).to_pylist() if text is not None)


def iter_documents(path: str | os.PathLike, text_field: str = "text") -> Iterator[str]:
    """The documents of one input file, in file order (see the module docstring for formats).

    ValueError naming the file and the byte offset when a text file is not UTF-8."""
    path = Path(path)
    kind = _kind(path)
    if kind == "txt":
        return _utf8_checked(path, _txt_documents(path))
    if kind == "jsonl":
        return _utf8_checked(path, _jsonl_documents(path, text_field))
    if kind == "parquet":
        return _parquet_documents(path, text_field)
    raise ValueError(f"unsupported input file {path}: use .txt, .jsonl or .parquet.")


def _utf8_checked(path: Path, documents: Iterator[str]) -> Iterator[str]:
    try:
        yield from documents
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{path} is not UTF-8 text ({err.reason} at byte {err.start} of a read block: "
            f"{err.object[err.start:err.start + 8]!r}). Fix: convert it, e.g. iconv -f latin1 -t "
            f"utf-8 {path.name} > {path.stem}.utf8{path.suffix}, or leave it out of data.inputs."
        ) from None


def iter_hf_documents(
    path: str, name: str | None = None, split: str = "train", text_field: str = "text"
) -> Iterator[str]:
    """Stream the documents of a Hugging Face dataset, e.g. ``("allenai/c4", "en")``.

    Needs the ``datasets`` package and network access to the Hugging Face Hub; without either,
    this call (not the first ``next``) raises ImportError or ConnectionError.
    """
    try:
        import datasets
    except ImportError as err:
        raise ImportError(
            f"streaming the Hugging Face dataset {path!r} needs the 'datasets' package: "
            "pip install datasets. Without network access, download the data elsewhere and pass "
            "its .jsonl/.parquet files as inputs instead."
        ) from err
    try:
        stream = datasets.load_dataset(path, name, split=split, streaming=True)
    except Exception as err:  # the Hub client raises many types; all mean "cannot open it"
        raise ConnectionError(
            f"could not open Hugging Face dataset {path!r} (config {name!r}, split {split!r}): "
            f"{err}. This needs network access to the Hugging Face Hub; without it, pass local "
            ".jsonl/.parquet files as inputs instead."
        ) from err
    return (record[text_field] for record in stream)


def _documents(
    files: Sequence[Path], hf_dataset: Mapping[str, Any] | None, text_field: str
) -> Iterator[str]:
    """All non-blank documents of the inputs, in order."""
    if hf_dataset:
        docs: Iterable[str] = iter_hf_documents(text_field=text_field, **hf_dataset)
    else:
        docs = (doc for path in files for doc in iter_documents(path, text_field))
    return (doc for doc in docs if doc.strip())


def val_mask(indices: np.ndarray, val_fraction: float) -> np.ndarray:
    """True where document ``indices`` belong to the validation split.

    Document ``i`` is a validation document when ``floor(i*f) != floor((i-1)*f)``: documents 0,
    1/f, 2/f, ... for ``f = val_fraction``; this needs no document count, so it works on streams.
    """
    indices = np.asarray(indices, dtype=np.float64)
    return np.floor(indices * val_fraction) != np.floor((indices - 1) * val_fraction)


def _train_documents(
    files: Sequence[Path],
    hf_dataset: Mapping[str, Any] | None,
    text_field: str,
    val_fraction: float,
) -> Iterator[str]:
    """The train-split documents, up to about `_TOKENIZER_TRAIN_CHARS` characters."""
    chars = 0
    for index, doc in enumerate(_documents(files, hf_dataset, text_field)):
        if chars >= _TOKENIZER_TRAIN_CHARS:
            return
        if not val_mask(np.array([index]), val_fraction)[0]:
            chars += len(doc)
            yield doc


# ----------------------------------------------------------------------------- tokenizing


def token_dtype(vocab_size: int) -> np.dtype:
    """The shard dtype: little-endian uint16 when every id fits in 16 bits, else uint32."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def _encode_docs(tokenizer: Tokenizer, docs: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """``docs``' token ids, each document followed by EOS, as one flat array; and the lengths."""
    ids = tokenizer.encode_batch(docs)
    lengths = np.array([len(x) + 1 for x in ids], dtype=np.int64)
    flat = np.empty(int(lengths.sum()), dtype=token_dtype(tokenizer.vocab_size))
    ends = np.cumsum(lengths)
    flat[ends - 1] = tokenizer.eos_id
    for end, x in zip(ends, ids, strict=True):
        flat[end - 1 - len(x) : end - 1] = x
    return flat, lengths


_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer_path: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = Tokenizer(tokenizer_path)


def _encode_in_worker(docs: list[str]) -> tuple[np.ndarray, np.ndarray]:
    assert _worker_tokenizer is not None, "_init_worker did not run"
    return _encode_docs(_worker_tokenizer, docs)


def _chunks(docs: Iterable[str]) -> Iterator[list[str]]:
    chunk: list[str] = []
    chars = 0
    for doc in docs:
        chunk.append(doc)
        chars += len(doc)
        if chars >= _CHUNK_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def _encoded(
    docs: Iterable[str], tokenizer: Tokenizer, num_workers: int
) -> Generator[tuple[np.ndarray, np.ndarray], None, None]:
    """`_encode_docs` over chunks of ``docs``, in order, on ``num_workers`` processes.

    At most two chunks per worker are in flight, so a stream is never read ahead into memory.
    Workers are spawned (not forked), which is safe in a process that already uses CUDA.
    """
    if num_workers <= 1:
        yield from map(partial(_encode_docs, tokenizer), _chunks(docs))
        return
    context = multiprocessing.get_context("spawn")
    with context.Pool(num_workers, _init_worker, (str(tokenizer.path),)) as pool:
        pending: deque = deque()
        for chunk in _chunks(docs):
            pending.append(pool.apply_async(_encode_in_worker, (chunk,)))
            if len(pending) >= 2 * num_workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


# ----------------------------------------------------------------------------- writing


class _ShardWriter:
    """Appends tokens to ``{split}_{index:06d}.bin`` files of at most ``shard_tokens`` tokens."""

    def __init__(self, out_dir: Path, split: str, shard_tokens: int) -> None:
        self.out_dir, self.split, self.shard_tokens = out_dir, split, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self.stream_hash = hashlib.sha256()  # over all the split's bytes, whatever the sharding
        self._file: IO[bytes] | None = None
        self._hash = hashlib.sha256()
        self._count = 0

    def write(self, tokens: np.ndarray) -> None:
        while len(tokens):
            if self._file is None:
                name = f"{self.split}_{len(self.shards):06d}.bin"
                self._file = open(self.out_dir / name, "wb")
                self._hash, self._count = hashlib.sha256(), 0
            take = min(len(tokens), self.shard_tokens - self._count)
            blob = tokens[:take].tobytes()
            self._file.write(blob)
            self._hash.update(blob)
            self.stream_hash.update(blob)
            self._count += take
            tokens = tokens[take:]
            if self._count == self.shard_tokens:
                self.close()

    def close(self) -> None:
        """Close the open shard (flushed to disk) and record it in `shards`."""
        if self._file is None:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        name = Path(self._file.name).name
        self.shards.append({"file": name, "tokens": self._count, "sha256": self._hash.hexdigest()})
        self._file = None


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``directory`` (for processes preparing it at the same time)."""
    with open(directory / ".lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _source_ids(files: Sequence[Path], hf_dataset: Mapping[str, Any] | None) -> list[Any]:
    """What identifies the inputs: each file's path, size and modification time, or the HF spec."""
    if hf_dataset:
        return [{"hf_dataset": dict(hf_dataset)}]
    return [
        {"path": str(p), "size": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns} for p in files
    ]


def load_manifest(dataset_dir: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a prepared dataset; FileNotFoundError when it is absent (not prepared)."""
    path = Path(dataset_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(
            f"no {MANIFEST} in {Path(dataset_dir).resolve()}: no complete dataset is there (never "
            "prepared, or its preparation stopped). Prepare it first: python -m data.prepare "
            "(see docs/data.md) or data.prepare.prepare_from_config."
        )
    return json.loads(path.read_text())


def _shards_intact(out_dir: Path, manifest: Mapping[str, Any]) -> bool:
    itemsize = np.dtype(manifest["dtype"]).itemsize
    return all(
        (out_dir / s["file"]).is_file()
        and (out_dir / s["file"]).stat().st_size == s["tokens"] * itemsize
        for split in manifest["splits"].values()
        for s in split["shards"]
    )


def _write_manifest(out_dir: Path, manifest: Mapping[str, Any]) -> None:
    tmp = out_dir / f".{MANIFEST}.tmp"
    with open(tmp, "w") as fh:
        json.dump(manifest, fh, indent=2)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, out_dir / MANIFEST)


def prepare(
    out_dir: str | os.PathLike,
    tokenizer_path: str | os.PathLike,
    inputs: Sequence[str | os.PathLike] = (),
    *,
    hf_dataset: Mapping[str, Any] | None = None,
    text_field: str = "text",
    val_fraction: float = 0.01,
    max_tokens: int | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    num_workers: int | None = None,
    progress: bool = True,
) -> Path:
    """Tokenize ``inputs`` (or ``hf_dataset``) into shards under ``out_dir``; return ``out_dir``.

    Args:
        out_dir: the dataset directory; created if needed. It must be empty, or hold a dataset (or
            an unfinished one) written by this function.
        tokenizer_path: a SentencePiece model file.
        inputs: files or directories (see the module docstring).
        hf_dataset: instead of inputs, keyword arguments of `iter_hf_documents` without
            ``text_field``: ``{"path": "allenai/c4", "name": "en", "split": "train"}``.
        text_field: the jsonl field / parquet column / HF column holding the text.
        val_fraction: fraction of documents put in the validation split, in [0, 1).
        max_tokens: stop after the document that brings the total (both splits) to this many.
        shard_tokens: tokens per shard file.
        num_workers: tokenizing processes; default ``min(4, cpu_count)``. The output does not
            depend on it.
        progress: show a progress bar.

    When ``out_dir`` already holds a complete dataset of the same inputs (same files by path,
    size and modification time), tokenizer and settings, it is reused as is. One of different
    inputs or settings is never overwritten: that raises ValueError.
    """
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}.")
    if max_tokens is not None and max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive or None, got {max_tokens}.")
    if shard_tokens <= 0:
        raise ValueError(f"shard_tokens must be positive, got {shard_tokens}.")
    if bool(inputs) == bool(hf_dataset):
        raise ValueError("give exactly one source: input files/directories, or an HF dataset.")
    files = expand_inputs(inputs)
    tokenizer = Tokenizer(tokenizer_path)
    workers = num_workers if num_workers is not None else min(4, os.cpu_count() or 1)
    recipe = {
        "sources": _source_ids(files, hf_dataset),
        "text_field": text_field,
        "tokenizer_sha256": tokenizer.sha256,
        "val_fraction": val_fraction,
        "max_tokens": max_tokens,
        "shard_tokens": shard_tokens,
        "format_version": FORMAT_VERSION,
    }
    recipe_id = _digest(recipe)
    out = Path(out_dir).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    ours = (out / MANIFEST).exists() or (out / ".incomplete").exists()
    if not ours and set(os.listdir(out)) - _OWN_NAMES:
        raise ValueError(
            f"{out} is not empty and holds no dataset prepared here. Choose an empty or new "
            "output directory; nothing in it was changed."
        )
    with _locked(out):
        if (out / MANIFEST).is_file():
            old = load_manifest(out)
            if old.get("recipe_id") != recipe_id:
                raise ValueError(
                    f"{out} already holds a dataset prepared from other inputs, tokenizer or "
                    f"settings (recipe {old.get('recipe_id', '?')[:12]}, now {recipe_id[:12]}). "
                    "Choose another output directory, or delete that one yourself."
                )
            if _shards_intact(out, old):
                return out
        (out / ".incomplete").touch()
        (out / MANIFEST).unlink(missing_ok=True)  # a damaged dataset of the same recipe
        manifest = _tokenize(
            out,
            tokenizer,
            files,
            hf_dataset,
            text_field,
            val_fraction,
            max_tokens,
            shard_tokens,
            workers,
            progress,
        )
        manifest.update(recipe_id=recipe_id, recipe=recipe)
        _write_manifest(out, manifest)
        (out / ".incomplete").unlink()
    return out


def _tokenize(
    out: Path,
    tokenizer: Tokenizer,
    files: Sequence[Path],
    hf_dataset: Mapping[str, Any] | None,
    text_field: str,
    val_fraction: float,
    max_tokens: int | None,
    shard_tokens: int,
    num_workers: int,
    progress: bool,
) -> dict[str, Any]:
    """Write the shards; return the manifest without its recipe."""
    writers = {split: _ShardWriter(out, split, shard_tokens) for split in ("train", "val")}
    documents = {"train": 0, "val": 0}
    total = 0
    docs = _documents(files, hf_dataset, text_field)
    bar = tqdm(
        total=max_tokens, unit="tok", unit_scale=True, desc="tokenizing", disable=not progress
    )
    try:
        with bar, contextlib.closing(_encoded(docs, tokenizer, num_workers)) as stream:
            for flat, lengths in stream:
                ends = total + np.cumsum(lengths)
                if max_tokens is not None and ends[-1] >= max_tokens:
                    keep = int(np.searchsorted(ends, max_tokens)) + 1
                    lengths, flat = lengths[:keep], flat[: int(lengths[:keep].sum())]
                first = documents["train"] + documents["val"]
                is_val = val_mask(np.arange(first, first + len(lengths)), val_fraction)
                token_is_val = np.repeat(is_val, lengths)
                writers["val"].write(flat[token_is_val])
                writers["train"].write(flat[~token_is_val])
                documents["val"] += int(is_val.sum())
                documents["train"] += int((~is_val).sum())
                total += len(flat)
                bar.update(len(flat))
                if max_tokens is not None and total >= max_tokens:
                    break
    finally:
        for writer in writers.values():
            writer.close()
    if total == 0:
        raise ValueError(
            "the corpus is empty: the inputs hold no non-blank documents, so there are 0 tokens. "
            "Check the input files (and, for jsonl/parquet/HF, the text field)."
        )
    if not writers["train"].shards:
        raise ValueError(
            f"the train split is empty: all {documents['val']} document(s) went to validation. "
            "Add documents or lower val_fraction."
        )
    splits = {
        split: {
            "documents": documents[split],
            "tokens": sum(s["tokens"] for s in writer.shards),
            "shards": writer.shards,
        }
        for split, writer in writers.items()
    }
    fingerprint = hashlib.sha256(tokenizer.sha256.encode())
    for split, writer in writers.items():
        fingerprint.update(f" {split}:{writer.stream_hash.hexdigest()}".encode())
    return {
        "format_version": FORMAT_VERSION,
        "dtype": token_dtype(tokenizer.vocab_size).name,
        "vocab_size": tokenizer.vocab_size,
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
        "tokenizer": {"path": str(tokenizer.path), "sha256": tokenizer.sha256},
        "splits": splits,
        "fingerprint": fingerprint.hexdigest(),
    }


# ----------------------------------------------------------------------------- config entry point


def _repo_path(path: str | os.PathLike) -> Path:
    """``path`` with ``~`` expanded; a relative path is taken relative to the repository root."""
    return REPO_ROOT / Path(path).expanduser()


def _mandatory_tokenizer_path(cfg: Mapping[str, Any]) -> str | None:
    """``cfg["tokenizer_path"]``; ValueError naming the fix when it is OmegaConf's unset
    mandatory value ``???``."""
    from omegaconf.errors import MissingMandatoryValue

    try:
        return cfg["tokenizer_path"]
    except MissingMandatoryValue:
        raise ValueError(
            f"data.tokenizer_path is not set, and the {cfg.get('name')} dataset has no tokenizer "
            f"of its own: it needs a SentencePiece model file (for C4, Llama-2's tokenizer.model "
            f"from Meta's Llama-2 release; it is not distributed here). Fix: add "
            f"data.tokenizer_path=/path/to/llama-2/tokenizer.model to the train.py command, or "
            f"prepare the dataset ahead: python -m data.prepare --config "
            f"configs/data/{cfg.get('name')}.yaml --set tokenizer_path=/path/to/llama-2/tokenizer.model"
        ) from None


def _mandatory_inputs(cfg: Mapping[str, Any]) -> list[Any]:
    """``cfg["inputs"]`` (empty when absent); ValueError naming the fix when it is OmegaConf's
    unset mandatory value ``???``, as in configs/data/files.yaml."""
    from omegaconf.errors import MissingMandatoryValue

    try:
        return list(cfg["inputs"] or [])
    except KeyError:
        return []
    except MissingMandatoryValue:
        raise ValueError(
            f"data.inputs is not set: the {cfg.get('name')} dataset reads your own files. Fix: add "
            "data.inputs=[/path/to/corpus.jsonl] (files or directories of .txt/.jsonl/.parquet) to "
            "the command."
        ) from None


def dataset_dir(cfg: Mapping[str, Any]) -> Path:
    """The directory ``{cache_dir}/{name}-{key}`` where :func:`prepare_from_config` prepares the
    dataset of the ``data`` config group ``cfg`` (see there for ``key``), prepared or not.

    Reads the inputs' sizes and modification times and the given tokenizer; writes nothing.
    ValueError or FileNotFoundError as :func:`prepare_from_config` for unset or missing inputs.
    """
    tokenizer_path = _mandatory_tokenizer_path(cfg)
    hf_dataset = dict(cfg["hf_dataset"]) if cfg.get("hf_dataset") else None
    files = expand_inputs(_repo_path(p) for p in _mandatory_inputs(cfg))
    given = Tokenizer(_repo_path(tokenizer_path)) if tokenizer_path else None
    return _dataset_dir(cfg, files, hf_dataset, given)


def _dataset_dir(cfg: Mapping[str, Any], files: Sequence[Path], hf_dataset: Mapping[str, Any] | None,
                 given_tokenizer: Tokenizer | None) -> Path:
    """:func:`dataset_dir` from the inputs and the given tokenizer already resolved."""
    key = _digest(
        {
            "sources": _source_ids(files, hf_dataset),
            "tokenizer": given_tokenizer.sha256 if given_tokenizer else {"train_bpe": int(cfg["vocab_size"])},
            "text_field": cfg.get("text_field") or "text",
            "val_fraction": float(cfg["val_fraction"]),
            "max_tokens": cfg.get("max_tokens"),
            "format_version": FORMAT_VERSION,
        }
    )
    return _repo_path(cfg["cache_dir"]) / f"{cfg['name']}-{key[:12]}"


def prepare_from_config(cfg: Mapping[str, Any]) -> Path:
    """Prepare the dataset described by the ``data`` config group; return its directory.

    The dataset lives in ``{cache_dir}/{name}-{key}``, ``key`` a hash of the inputs (files by
    path, size and modification time), the tokenizer, ``vocab_size``, ``text_field``,
    ``val_fraction`` and ``max_tokens``; relative paths are taken from the repository root. When
    ``tokenizer_path`` is null, a BPE tokenizer of ``vocab_size`` pieces is trained on the train
    split into ``tokenizer.model`` in that directory. Existing tokenizer and shards are reused, so
    calling this again is cheap. Concurrent callers (e.g. every rank) are serialised by a file
    lock, but the usual pattern is: rank 0 calls it, barrier, the other ranks call it.

    ValueError when ``vocab_size`` differs from the tokenizer's, so ``cfg.vocab_size`` can be used
    for the model's embedding; the manifest's ``vocab_size`` is the same number. ValueError, before
    anything is read or written, when ``tokenizer_path`` is mandatory (``???``, as in
    configs/data/c4.yaml) and not set.
    """
    tokenizer_path = _mandatory_tokenizer_path(cfg)
    hf_dataset = dict(cfg["hf_dataset"]) if cfg.get("hf_dataset") else None
    files = expand_inputs(_repo_path(p) for p in _mandatory_inputs(cfg))
    text_field = cfg.get("text_field") or "text"
    vocab_size = int(cfg["vocab_size"])
    val_fraction = float(cfg["val_fraction"])
    max_tokens = cfg.get("max_tokens")
    given_tokenizer = Tokenizer(_repo_path(tokenizer_path)) if tokenizer_path else None
    out = _dataset_dir(cfg, files, hf_dataset, given_tokenizer)
    if given_tokenizer:
        tokenizer = given_tokenizer
    elif (out / "tokenizer.model").is_file():
        tokenizer = Tokenizer(out / "tokenizer.model")
    else:  # deterministic and written by rename: concurrent trainers write the same file
        docs = _train_documents(files, hf_dataset, text_field, val_fraction)
        tokenizer = train_tokenizer(docs, out / "tokenizer.model", vocab_size)
    if tokenizer.vocab_size != vocab_size:
        raise ValueError(
            f"data.vocab_size is {vocab_size} but the tokenizer {tokenizer.path} has "
            f"{tokenizer.vocab_size} pieces. Set data.vocab_size={tokenizer.vocab_size}."
        )
    return prepare(
        out,
        tokenizer.path,
        files,
        hf_dataset=hf_dataset,
        text_field=text_field,
        val_fraction=val_fraction,
        max_tokens=max_tokens,
        num_workers=cfg.get("num_workers"),
    )


# ----------------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> Path:
    """Command line: see ``python -m data.prepare --help``."""
    parser = argparse.ArgumentParser(
        prog="python -m data.prepare",
        description="Tokenize a corpus into token shards (see docs/data.md).",
    )
    parser.add_argument("inputs", nargs="*", help=".txt/.jsonl/.parquet files or directories")
    parser.add_argument("--config", help="a configs/data/*.yaml file; prepares it into its cache")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a key of --config (repeatable)",
    )
    parser.add_argument("--out", help="output directory (without --config)")
    parser.add_argument("--tokenizer", help="SentencePiece model file to use")
    parser.add_argument(
        "--vocab-size", type=int, help="instead of --tokenizer: train a BPE tokenizer of this size"
    )
    parser.add_argument("--hf-dataset", help="Hugging Face dataset to stream, e.g. allenai/c4")
    parser.add_argument("--hf-config", help="its configuration, e.g. en")
    parser.add_argument("--hf-split", default="train", help="its split (default: train)")
    parser.add_argument("--text-field", default="text", help="jsonl field / column with the text")
    parser.add_argument("--val-fraction", type=float, default=0.01)
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS)
    parser.add_argument("--num-workers", type=int, help="default: min(4, cpu_count)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    if args.config:
        from omegaconf import OmegaConf

        cfg = OmegaConf.merge(OmegaConf.load(args.config), OmegaConf.from_dotlist(args.set))
        out = prepare_from_config(cfg)
    else:
        if not args.out:
            parser.error("give --out (or --config)")
        hf = {"path": args.hf_dataset, "name": args.hf_config, "split": args.hf_split}
        tokenizer_path = args.tokenizer
        if (tokenizer_path is None) == (args.vocab_size is None):
            parser.error("give either --tokenizer, or --vocab-size to train a tokenizer")
        if tokenizer_path is None:
            tokenizer_path = Path(args.out) / "tokenizer.model"
            if not tokenizer_path.is_file():
                docs = _train_documents(
                    expand_inputs(args.inputs),
                    hf if args.hf_dataset else None,
                    args.text_field,
                    args.val_fraction,
                )
                train_tokenizer(docs, tokenizer_path, args.vocab_size)
        out = prepare(
            args.out,
            tokenizer_path,
            args.inputs,
            hf_dataset=hf if args.hf_dataset else None,
            text_field=args.text_field,
            val_fraction=args.val_fraction,
            max_tokens=args.max_tokens,
            shard_tokens=args.shard_tokens,
            num_workers=args.num_workers,
            progress=not args.quiet,
        )
    manifest = load_manifest(out)
    counts = ", ".join(f"{k} {v['tokens']:,} tokens" for k, v in manifest["splits"].items())
    print(f"{out}: vocab_size {manifest['vocab_size']}, {counts}")
    return out


def cli(argv: Sequence[str] | None = None) -> int:
    """The ``nvfp4-prepare`` command: :func:`main`, with bad input reported as one ``error:``
    line and exit status 1."""
    try:
        main(argv)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli())
