"""The units of a format-2 dataset, each input file tokenized on its own, and the final step.

Unit ``u`` is the ``u``-th input file of the sorted input list (the whole stream, for a Hugging
Face dataset). It holds every non-blank document of that file, in file order, each followed by EOS:

- ``units/{u:06d}.bin``: the token ids, raw little-endian, in the dataset's dtype;
- ``units/{u:06d}.len``: each document's length in tokens, EOS included, as ``<u4``;
- ``ledger/{u:06d}.json``: the unit's record (its source, documents, tokens and the SHA-256 of
  both files), written after both files by an atomic rename: its presence marks a finished unit.

A unit depends on nothing but its file and the tokenizer, so units can be tokenized in any order,
by any number of processes on any number of nodes, and the files come out the same.

The final step (`finalize`) derives the splits from the finished units. Documents are numbered
from 0 across the units in unit order; document ``i`` goes to validation when ``val_mask(i)``
says so; the dataset ends with the document that brings the total (both splits) to
``max_tokens``. A split is the list of its extents ``(unit, offset, tokens)``: the maximal runs of
its documents inside each unit, in unit order. Their concatenation is the split's token stream.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

UNITS = "units"
LEDGER = "ledger"
LENGTH_DTYPE = np.dtype("<u4")
_BLOCK = 1 << 24  # bytes read at a time when hashing a file


class UnitError(ValueError):
    """A unit the final step needs is unfinished, missing or does not match its ledger record."""


def unit_files(out_dir: Path, unit: int) -> tuple[Path, Path]:
    """The token file and the document-length file of ``unit``."""
    return out_dir / UNITS / f"{unit:06d}.bin", out_dir / UNITS / f"{unit:06d}.len"


def record_path(out_dir: Path, unit: int) -> Path:
    """The ledger record of ``unit``."""
    return out_dir / LEDGER / f"{unit:06d}.json"


def read_record(out_dir: Path, unit: int) -> dict[str, Any] | None:
    """The ledger record of ``unit``, or None when the unit is not finished."""
    path = record_path(out_dir, unit)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def _temporary(path: Path) -> Path:
    """A temporary name next to ``path``, private to this process on this host."""
    return path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")


def write_json(path: Path, obj: Any, text: str | None = None) -> None:
    """Write ``obj`` as JSON (or ``text``) to ``path`` atomically: a flushed temporary file, then
    a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary(path)
    with open(tmp, "w") as fh:
        fh.write(json.dumps(obj, indent=2) if text is None else text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def finished(out_dir: Path, unit: int, source: Any, itemsize: int) -> dict[str, Any] | None:
    """The record of ``unit`` when it is finished for ``source`` and its two files have the
    recorded sizes; else None (the unit must be tokenized)."""
    record = read_record(out_dir, unit)
    if record is None or record["source"] != source:
        return None
    tokens, lengths = unit_files(out_dir, unit)
    sizes_ok = (
        tokens.is_file()
        and lengths.is_file()
        and tokens.stat().st_size == record["tokens"] * itemsize
        and lengths.stat().st_size == record["documents"] * LENGTH_DTYPE.itemsize
    )
    return record if sizes_ok else None


def write_unit(
    out_dir: Path, unit: int, source: Any, encoded: Iterable[tuple[np.ndarray, np.ndarray]]
) -> dict[str, Any]:
    """Write ``unit`` from ``encoded``, (tokens, document lengths) pairs in document order; then
    its ledger record, which it returns.

    Both files are written under temporary names, flushed to disk and renamed; the record comes
    last, so a process killed at any point leaves the unit unfinished, never half written.
    """
    paths = unit_files(out_dir, unit)
    paths[0].parent.mkdir(parents=True, exist_ok=True)
    tmps = [_temporary(p) for p in paths]
    hashes = [hashlib.sha256(), hashlib.sha256()]
    documents = tokens = 0
    try:
        with open(tmps[0], "wb") as token_file, open(tmps[1], "wb") as length_file:
            for flat, lengths in encoded:
                blobs = (flat.tobytes(), np.asarray(lengths).astype(LENGTH_DTYPE).tobytes())
                for fh, digest, blob in zip((token_file, length_file), hashes, blobs, strict=True):
                    fh.write(blob)
                    digest.update(blob)
                documents += len(lengths)
                tokens += len(flat)
            for fh in (token_file, length_file):
                fh.flush()
                os.fsync(fh.fileno())
        for tmp, path in zip(tmps, paths, strict=True):
            os.replace(tmp, path)
    finally:
        for tmp in tmps:
            tmp.unlink(missing_ok=True)
    record = {
        "unit": unit,
        "source": source,
        "documents": documents,
        "tokens": tokens,
        "sha256": hashes[0].hexdigest(),
        "lengths_sha256": hashes[1].hexdigest(),
    }
    write_json(record_path(out_dir, unit), record)
    return record


def needed_records(
    out_dir: Path, sources: Sequence[Any], max_tokens: int | None
) -> tuple[list[dict[str, Any] | None], list[int]]:
    """(the ledger records of the units the dataset needs, None where unfinished; the indices of
    the unfinished ones).

    Every unit is needed, except the units after the first one where the finished units before
    them hold ``max_tokens`` tokens or more.
    """
    records: list[dict[str, Any] | None] = []
    missing: list[int] = []
    total = 0
    for unit, source in enumerate(sources):
        if max_tokens is not None and not missing and total >= max_tokens:
            break
        record = read_record(out_dir, unit)
        if record is None or record["source"] != source:
            records.append(None)
            missing.append(unit)
        else:
            records.append(record)
            total += record["tokens"]
    return records, missing


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def unit_problem(out_dir: Path, record: dict[str, Any], itemsize: int) -> str | None:
    """What is wrong with a finished unit's files (missing, of another size than its record says;
    the length file also of other bytes), or None. `stream_hashes` checks the token file's bytes."""
    tokens, lengths = unit_files(out_dir, record["unit"])
    checks = (
        (tokens, record["tokens"] * itemsize, None),
        (lengths, record["documents"] * LENGTH_DTYPE.itemsize, record["lengths_sha256"]),
    )
    for path, size, sha256 in checks:
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != size:
            return f"{path} is {path.stat().st_size} bytes, its ledger record says {size}"
        if sha256 is not None and _file_sha256(path) != sha256:
            return _other_bytes(path)
    return None


def _other_bytes(path: Path) -> str:
    return f"{path} does not hold the bytes of its ledger record (SHA-256 differs)"


def _describe(sources: Sequence[Any], units: Sequence[int]) -> str:
    shown = ", ".join(f"{u} ({_source_name(sources[u])})" for u in units[:10])
    return shown + (f" and {len(units) - 10} more" if len(units) > 10 else "")


def _source_name(source: Any) -> str:
    return str(source.get("path") or source.get("hf_dataset")) if isinstance(source, dict) else str(source)


def checked_records(
    out_dir: Path, sources: Sequence[Any], itemsize: int, max_tokens: int | None
) -> list[dict[str, Any]]:
    """The records of the units the dataset needs, each checked against its files.

    UnitError naming the units when some are unfinished; UnitError naming the unit, its source and
    its file when one is missing or corrupt; that unit's record is then removed, so that running
    the preparation again tokenizes it again.
    """
    records, missing = needed_records(out_dir, sources, max_tokens)
    if missing:
        raise UnitError(
            f"the final step needs {len(missing)} unfinished unit(s) of {out_dir}: "
            f"{_describe(sources, missing)}. Fix: run the preparation of the part(s) holding them "
            "again (the same command; finished units are skipped), then the final step."
        )
    checked = [r for r in records if r is not None]
    for record in checked:
        problem = unit_problem(out_dir, record, itemsize)
        if problem:
            raise damaged(out_dir, sources, record, problem)
    return checked


def damaged(out_dir: Path, sources: Sequence[Any], record: dict[str, Any], problem: str) -> UnitError:
    """Remove the ledger record of a damaged unit (so that it is tokenized again); the error that
    names it, its source and ``problem``."""
    record_path(out_dir, record["unit"]).unlink(missing_ok=True)
    return UnitError(
        f"unit {record['unit']} ({_source_name(sources[record['unit']])}) is damaged: "
        f"{problem}. Its ledger record was removed. Fix: run the same preparation again "
        "(it tokenizes that unit again), then the final step."
    )


def split_extents(
    lengths: Iterable[np.ndarray],
    val_mask: Callable[[np.ndarray], np.ndarray],
    max_tokens: int | None,
) -> dict[str, dict[str, Any]]:
    """Each split's documents and extents ``[unit, offset, tokens]`` from the units' document
    lengths (in unit order), ``val_mask`` of global document indices, and ``max_tokens``."""
    parts: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    documents = {"train": 0, "val": 0}
    first_document = total = 0
    for unit, unit_lengths in enumerate(lengths):
        unit_lengths = np.asarray(unit_lengths, dtype=np.int64)
        ends = total + np.cumsum(unit_lengths)
        last = max_tokens is not None and len(ends) > 0 and ends[-1] >= max_tokens
        if last:
            unit_lengths = unit_lengths[: int(np.searchsorted(ends, max_tokens)) + 1]
        count = len(unit_lengths)
        is_val = val_mask(np.arange(first_document, first_document + count))
        offsets = np.concatenate([[0], np.cumsum(unit_lengths)])
        changes = np.flatnonzero(np.diff(is_val.astype(np.int8))) + 1
        run_starts = np.concatenate([[0], changes]).astype(np.int64)
        run_ends = np.concatenate([changes, [count]]).astype(np.int64)
        if count:
            runs = np.stack(
                [np.full(len(run_starts), unit), offsets[run_starts], offsets[run_ends] - offsets[run_starts]],
                axis=1,
            )
            run_is_val = is_val[run_starts]
            parts["val"].append(runs[run_is_val])
            parts["train"].append(runs[~run_is_val])
        documents["val"] += int(is_val.sum())
        documents["train"] += count - int(is_val.sum())
        first_document += count
        total += int(offsets[-1])
        if last:
            break
    splits = {}
    for split, runs in parts.items():
        extents = np.concatenate(runs) if runs else np.zeros((0, 3), dtype=np.int64)
        splits[split] = {
            "documents": documents[split],
            "tokens": int(extents[:, 2].sum()),
            "extents": extents.tolist(),
        }
    return splits


def stream_hashes(
    out_dir: Path,
    sources: Sequence[Any],
    records: Sequence[dict[str, Any]],
    splits: dict[str, dict[str, Any]],
    dtype: np.dtype,
) -> dict[str, str]:
    """Each split's SHA-256 (of its extents' tokens, in order), reading every unit once; each unit
    file's SHA-256 is checked against its record on the way. UnitError as `checked_records` for a
    unit whose token file holds other bytes."""
    digests = {split: hashlib.sha256() for split in splits}
    runs: dict[int, list[tuple[int, int, str]]] = {}
    for split, info in splits.items():
        for unit, offset, tokens in info["extents"]:
            runs.setdefault(unit, []).append((offset, tokens, split))
    for record in records:
        path = unit_files(out_dir, record["unit"])[0]
        tokens = np.memmap(path, dtype=dtype, mode="r") if record["tokens"] else np.zeros(0, dtype)
        whole = hashlib.sha256()
        done = 0
        for offset, count, split in sorted(runs.get(record["unit"], [])):
            whole.update(tokens[done:offset])
            whole.update(tokens[offset : offset + count])  # contiguous views: no copies
            digests[split].update(tokens[offset : offset + count])
            done = offset + count
        whole.update(tokens[done:])
        if whole.hexdigest() != record["sha256"]:
            raise damaged(out_dir, sources, record, _other_bytes(path))
    return {split: digest.hexdigest() for split, digest in digests.items()}


def prune(out_dir: Path, keep: int) -> None:
    """Remove the units from ``keep`` on (finished beyond ``max_tokens``, so outside the dataset)
    and the temporary files of killed writers."""
    for folder in (out_dir / UNITS, out_dir / LEDGER):
        if not folder.is_dir():
            continue
        for path in folder.iterdir():
            stem = path.name.split(".")[0]
            if path.name.startswith(".") and path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)
            elif stem.isdigit() and int(stem) >= keep:
                path.unlink(missing_ok=True)
