"""A corpus of real text gathered from the software installed on a machine.

GPU machines without network access and without datasets still hold hundreds of megabytes of
human-written text: the source and documentation of their Python installation. This module
collects it into one ``.jsonl`` file of documents (one file per document, in the ``text`` field),
ready for :func:`data.prepare.prepare`:

1. every regular file under the roots whose name ends in one of ``suffixes`` (or is named in
   ``NAMES``), in sorted path order, roots deduplicated after resolving links;
2. kept when it is UTF-8, has at least ``min_chars`` characters and at most ``max_bytes`` bytes
   (larger files are mostly generated tables);
3. exact duplicates dropped by the SHA-256 of their content, keeping the first path: the same
   module vendored by several packages, or installed in two environments, appears once.

The order is a pure function of the file tree, so ``val_fraction`` in data.prepare holds out the
same whole files on two machines with the same installation.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import site
import sys
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

SUFFIXES = (".py", ".pyi", ".h", ".hpp", ".cuh", ".txt", ".rst", ".md")
NAMES = ("METADATA", "PKG-INFO")  # package descriptions
MIN_CHARS = 200
MAX_BYTES = 1 << 20


def default_roots() -> list[Path]:
    """The Python installation running this: its standard library, site-packages and headers."""
    paths = sysconfig.get_paths()
    candidates = [paths[k] for k in ("stdlib", "purelib", "platlib", "include")]
    candidates += site.getsitepackages()
    return _distinct_roots(Path(p) for p in candidates)


def _distinct_roots(paths: Iterable[Path]) -> list[Path]:
    """Existing directories, resolved, without any that lies inside another."""
    resolved = sorted({p.resolve() for p in paths if p.is_dir()})
    return [p for p in resolved if not any(q != p and q in p.parents for q in resolved)]


@dataclass
class CorpusStats:
    """What :func:`collect` saw: files matched, kept, and dropped by reason."""

    matched: int = 0
    kept: int = 0
    duplicate: int = 0
    not_utf8: int = 0
    too_short: int = 0
    too_large: int = 0
    chars: int = 0
    by_suffix: dict[str, int] = field(default_factory=dict)


def _wanted(path: Path, suffixes: Sequence[str]) -> bool:
    return path.name in NAMES or path.suffix in suffixes


def _files(roots: Sequence[Path], suffixes: Sequence[str]) -> Iterator[Path]:
    for root in roots:
        for directory, dirs, names in os.walk(root):
            dirs.sort()
            for name in sorted(names):
                path = Path(directory, name)
                if _wanted(path, suffixes) and path.is_file() and not path.is_symlink():
                    yield path


def collect(
    roots: Sequence[str | os.PathLike],
    suffixes: Sequence[str] = SUFFIXES,
    min_chars: int = MIN_CHARS,
    max_bytes: int = MAX_BYTES,
) -> tuple[Iterator[str], CorpusStats]:
    """The deduplicated documents under ``roots`` (module docstring), and their running stats.

    The stats are complete once the iterator is exhausted."""
    found = _distinct_roots(Path(r).expanduser() for r in roots)
    if not found:
        raise FileNotFoundError(
            f"none of the corpus roots {[str(r) for r in roots]} is a directory. Give existing "
            "directories (default: this Python's stdlib, site-packages and headers)."
        )
    stats = CorpusStats()

    def documents() -> Iterator[str]:
        seen: set[bytes] = set()
        for path in _files(found, suffixes):
            stats.matched += 1
            if path.stat().st_size > max_bytes:
                stats.too_large += 1
                continue
            raw = path.read_bytes()
            digest = hashlib.sha256(raw).digest()
            if digest in seen:
                stats.duplicate += 1
                continue
            seen.add(digest)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                stats.not_utf8 += 1
                continue
            if len(text.strip()) < min_chars:
                stats.too_short += 1
                continue
            stats.kept += 1
            stats.chars += len(text)
            key = path.suffix or path.name
            stats.by_suffix[key] = stats.by_suffix.get(key, 0) + len(text)
            yield text

    return documents(), stats


def write_jsonl(documents: Iterable[str], out: str | os.PathLike) -> Path:
    """Write ``{"text": ...}`` lines to ``out`` atomically (temporary file, then rename)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        for text in documents:
            fh.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    os.replace(tmp, out)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python -m data.installed_text OUT.jsonl [--root DIR ...]``."""
    parser = argparse.ArgumentParser(
        prog="python -m data.installed_text",
        description="Gather the source and documentation installed on this machine into a "
        "deduplicated .jsonl corpus (docs/data.md).",
    )
    parser.add_argument("out", help="the .jsonl file to write")
    parser.add_argument(
        "--root",
        action="append",
        help="a directory to gather from (repeatable; default: this Python's stdlib, "
        "site-packages and headers)",
    )
    parser.add_argument("--suffix", action="append", help=f"file suffixes (default: {SUFFIXES})")
    parser.add_argument("--min-chars", type=int, default=MIN_CHARS)
    parser.add_argument("--max-bytes", type=int, default=MAX_BYTES)
    args = parser.parse_args(argv)
    if not args.out.endswith(".jsonl"):
        parser.error(f"the output must be a .jsonl file, got {args.out}")
    roots = args.root or default_roots()
    try:
        documents, stats = collect(
            roots, tuple(args.suffix or SUFFIXES), args.min_chars, args.max_bytes
        )
        write_jsonl(documents, args.out)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    summary = {"roots": [str(r) for r in roots], **stats.__dict__}
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
