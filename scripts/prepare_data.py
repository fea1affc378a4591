"""Prepare the dataset of a train.py configuration ahead of training, and print what it holds.

    python scripts/prepare_data.py experiment=paper_30m data.inputs=[/path/corpus.jsonl]
    python scripts/prepare_data.py data=c4 data.tokenizer_path=/path/tokenizer.model data.num_workers=32

The arguments are train.py's Hydra overrides; the dataset is the one train.py would prepare (or
reuse) for them, in the same cache directory. Prints one JSON object: the dataset directory, its
tokenizer, vocabulary size, and the documents and tokens of each split. Bad overrides or inputs
are reported as one ``error:`` line and exit status 1.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from data.prepare import load_manifest, prepare_from_config  # noqa: E402


def dataset_summary(overrides: Sequence[str]) -> dict[str, Any]:
    """Prepare the dataset of ``train.yaml`` under ``overrides``; return its summary."""
    with initialize_config_dir(str(REPO_ROOT / "configs"), version_base=None):
        cfg = compose("train", list(overrides))
    out = prepare_from_config(cfg.data)
    manifest = load_manifest(out)
    given = cfg.data.tokenizer_path
    tokenizer = out / "tokenizer.model" if given is None else Path(given)
    splits = {
        split: {"documents": info["documents"], "tokens": info["tokens"]}
        for split, info in manifest["splits"].items()
    }
    return {
        "dir": str(out),
        "tokenizer": str(tokenizer),
        "vocab_size": manifest["vocab_size"],
        **splits,
    }


def main(argv: Sequence[str] | None = None) -> int:
    overrides = sys.argv[1:] if argv is None else list(argv)
    if any(arg in ("-h", "--help") for arg in overrides):
        print(__doc__)
        return 0
    try:
        summary = dataset_summary(overrides)
    except (HydraException, OmegaConfBaseException, ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
