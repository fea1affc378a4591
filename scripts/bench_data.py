"""Measure the data pipeline: tokenizing throughput per core, and the loader's start-up on a large
dataset.

    python scripts/bench_data.py tokenize CORPUS --vocab-size 32000 [--train-chars N] [--bench-chars N]
    python scripts/bench_data.py tokenize CORPUS --tokenizer MODEL --train-chars 0 [--bench-chars N]
    python scripts/bench_data.py synthetic DIR --tokens 10e9
    python scripts/bench_data.py loader DIR [--seq-len 512 --batch 512 --world-size 8]

``tokenize`` trains a SentencePiece BPE of ``--vocab-size`` pieces on the first ``--train-chars``
characters of CORPUS (a .txt/.jsonl file that data.prepare reads), or takes ``--tokenizer``,
then prepares the next
``--bench-chars`` characters with `data.prepare.prepare` and one worker (this process: reading,
tokenizing and writing on one core), and prints tokens/s and the hours that 38B tokens take on 16,
64 and 512 such cores. ``synthetic`` writes a format-2 dataset of ``--tokens`` tokens whose unit
files are sparse (they take no disk space and read as zeros), with C4-like units of 150M tokens
and a validation document of 500 tokens every 1M tokens. ``loader`` builds a `TokenLoader` of rank
0 on DIR and reports the seconds to construct it and to return its first batch (which draws the
epoch's order), and the process's resident memory (peak and after the batch). Each prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from data import units  # noqa: E402
from data.prepare import FORMAT_VERSION, MANIFEST, expand_inputs, iter_documents, load_manifest, prepare  # noqa: E402
from data.tokenizer import Tokenizer, train_tokenizer  # noqa: E402

MISSION_TOKENS = 38_000_000_000
CORES = (16, 64, 512)


def _documents_up_to(path: Path, skip_chars: int, chars: int) -> Iterator[str]:
    """The documents of ``path`` after the first ``skip_chars`` characters, up to ``chars`` more."""
    seen = taken = 0
    for doc in iter_documents(path):
        if not doc.strip():
            continue
        if seen < skip_chars:
            seen += len(doc)
            continue
        if taken >= chars:
            return
        taken += len(doc)
        yield doc


def bench_tokenize(corpus: Path, work: Path, vocab_size: int, train_chars: int, bench_chars: int,
                   model: Path | None = None) -> dict[str, Any]:
    """Train the tokenizer (reused when present; ``model`` instead when given), prepare the
    benchmark slice on one core, and return the throughput and the derived times for
    `MISSION_TOKENS`."""
    work.mkdir(parents=True, exist_ok=True)
    model = model or work / f"bpe{vocab_size}.model"
    tokenizer = Tokenizer(model) if model.is_file() else train_tokenizer(
        _documents_up_to(corpus, 0, train_chars), model, vocab_size)
    slice_file = work / "bench.jsonl"
    with open(slice_file, "w", encoding="utf-8") as fh:
        for doc in _documents_up_to(corpus, train_chars, bench_chars):
            fh.write(json.dumps({"text": doc}) + "\n")
    out = work / f"ds-{os.getpid()}"
    start = time.perf_counter()
    prepare(out, tokenizer.path, [slice_file], val_fraction=0.0005, num_workers=1, progress=False)
    seconds = time.perf_counter() - start
    manifest = load_manifest(out)
    tokens = sum(split["tokens"] for split in manifest["splits"].values())
    chars = sum(len(d) for d in _documents_up_to(slice_file, 0, bench_chars))
    rate = tokens / seconds
    return {
        "corpus": str(corpus),
        "vocab_size": tokenizer.vocab_size,
        "characters": chars,
        "tokens": tokens,
        "chars_per_token": round(chars / tokens, 3),
        "seconds": round(seconds, 2),
        "tokens_per_s_per_core": round(rate),
        "hours_for_38B": {cores: round(MISSION_TOKENS / (rate * cores) / 3600, 2) for cores in CORES},
    }


def make_synthetic_dataset(out: str | os.PathLike, tokens: int, unit_tokens: int = 150_000_000,
                           doc_tokens: int = 500, val_every: int = 2000) -> Path:
    """A format-2 dataset of ``tokens`` uint16 tokens in sparse unit files of ``unit_tokens``;
    every ``val_every``-th document of ``doc_tokens`` goes to validation. Its token files read as
    zeros and take no disk space; its fingerprint is a label, not a hash of the tokens."""
    out = Path(out)
    (out / units.UNITS).mkdir(parents=True, exist_ok=True)
    unit_list, train, val = [], [], []
    period = doc_tokens * val_every
    for unit, begin in enumerate(range(0, tokens, unit_tokens)):
        count = min(unit_tokens, tokens - begin)
        path = units.unit_files(out, unit)[0]
        with open(path, "wb") as fh:
            fh.truncate(count * 2)
        unit_list.append({"file": f"{units.UNITS}/{path.name}", "tokens": count, "sha256": "synthetic"})
        cursor = 0
        for val_start in range(0, count, period):
            val_end = min(val_start + doc_tokens, count)
            if val_start > cursor:
                train.append([unit, cursor, val_start - cursor])
            val.append([unit, val_start, val_end - val_start])
            cursor = val_end
        if cursor < count:
            train.append([unit, cursor, count - cursor])
    splits = {
        name: {"documents": len(extents), "tokens": sum(e[2] for e in extents), "extents": extents}
        for name, extents in (("train", train), ("val", val))
    }
    manifest = {
        "format_version": FORMAT_VERSION, "dtype": "uint16", "vocab_size": 32000, "bos_id": 1, "eos_id": 2,
        "tokenizer": {"path": "synthetic", "sha256": "synthetic"}, "units": unit_list, "splits": splits,
        "fingerprint": f"synthetic-{tokens}",
    }
    units.write_json(out / MANIFEST, manifest, json.dumps(manifest))
    return out


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def bench_loader(dataset: Path, seq_len: int, batch: int, world_size: int) -> dict[str, Any]:
    """Start-up seconds and resident memory of rank 0's `TokenLoader` on ``dataset``."""
    import_start = time.perf_counter()
    from data.loader import TokenLoader

    imported = time.perf_counter()
    base = _rss_mib()
    loader = TokenLoader(dataset, "train", seq_len, batch, rank=0, world_size=world_size)
    built = time.perf_counter()
    loader.next_batch()
    first = time.perf_counter()
    return {
        "dataset": str(dataset),
        "train_tokens": load_manifest(dataset)["splits"]["train"]["tokens"],
        "samples": loader.num_samples,
        "extents": len(load_manifest(dataset)["splits"]["train"]["extents"]),
        "import_s": round(imported - import_start, 2),
        "construct_s": round(built - imported, 3),
        "first_batch_s": round(first - built, 2),
        "rss_before_mib": round(base),
        "rss_after_mib": round(_rss_mib()),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/bench_data.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    tok = sub.add_parser("tokenize")
    tok.add_argument("corpus")
    tok.add_argument("--work", default="/tmp/bench_data")
    tok.add_argument("--vocab-size", type=int, default=32000)
    tok.add_argument("--train-chars", type=float, default=20e6)
    tok.add_argument("--bench-chars", type=float, default=20e6)
    tok.add_argument("--tokenizer", type=Path, help="a SentencePiece model to use instead of training one")
    syn = sub.add_parser("synthetic")
    syn.add_argument("out")
    syn.add_argument("--tokens", type=float, default=10e9)
    load = sub.add_parser("loader")
    load.add_argument("dataset")
    load.add_argument("--seq-len", type=int, default=512)
    load.add_argument("--batch", type=int, default=512)
    load.add_argument("--world-size", type=int, default=8)
    args = parser.parse_args(argv)
    if args.command == "tokenize":
        corpus = expand_inputs([args.corpus])[0]
        result = bench_tokenize(corpus, Path(args.work), args.vocab_size, int(args.train_chars),
                                int(args.bench_chars), args.tokenizer)
    elif args.command == "synthetic":
        out = make_synthetic_dataset(args.out, int(args.tokens))
        result = {"dir": str(out), "tokens": int(args.tokens)}
    else:
        result = bench_loader(Path(args.dataset), args.seq_len, args.batch, args.world_size)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
