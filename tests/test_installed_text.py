"""Tests of data.installed_text (a corpus gathered from installed files) and scripts/prepare_data.py
(the dataset of a train.py configuration, prepared ahead of training)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from data import installed_text
from data.prepare import load_manifest

REPO = Path(__file__).resolve().parents[1]
BODY = "def f(x):\n    return x + 1\n" * 20  # 560 characters


def _tree(root: Path) -> None:
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "vendored" / "pkg").mkdir(parents=True)
    (root / "pkg" / "a.py").write_text(BODY + "# a\n")
    (root / "pkg" / "sub" / "b.h").write_text(BODY + "// b\n")
    (root / "vendored" / "pkg" / "a.py").write_text(BODY + "# a\n")  # same bytes as pkg/a.py
    (root / "pkg" / "short.py").write_text("x = 1\n")
    (root / "pkg" / "latin1.txt").write_bytes(("caf\xe9 " * 100).encode("latin-1"))
    (root / "pkg" / "big.py").write_text("#" * 3000)
    (root / "pkg" / "data.bin").write_bytes(b"\0" * 1000)
    (root / "pkg" / "METADATA").write_text("Name: pkg\n" + "Description. " * 30)
    (root / "pkg" / "link.py").symlink_to(root / "pkg" / "a.py")


def test_collect_keeps_unique_utf8_text_in_path_order(tmp_path: Path) -> None:
    _tree(tmp_path)
    # the second root lies inside the first: gathered once
    docs, stats = installed_text.collect([tmp_path, tmp_path / "pkg"], max_bytes=2000)
    docs = list(docs)
    assert docs == [
        (tmp_path / "pkg" / "METADATA").read_text(),
        BODY + "# a\n",
        BODY + "// b\n",
    ]
    assert (stats.matched, stats.kept, stats.duplicate) == (7, 3, 1)
    assert (stats.not_utf8, stats.too_short, stats.too_large) == (1, 1, 1)
    assert stats.chars == sum(map(len, docs)) == sum(stats.by_suffix.values())
    assert set(stats.by_suffix) == {"METADATA", ".py", ".h"}


def test_cli_writes_jsonl_that_prepare_reads(tmp_path: Path) -> None:
    _tree(tmp_path / "tree")
    out = tmp_path / "corpus.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "data.installed_text", str(out), "--root", str(tmp_path / "tree")],
        cwd=REPO, capture_output=True, text=True, check=True,
    )
    assert json.loads(proc.stdout)["kept"] == 4  # big.py is kept below the default size limit
    texts = [json.loads(line)["text"] for line in out.read_text().splitlines()]
    assert len(texts) == 4 and BODY + "# a\n" in texts


def test_missing_roots_are_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="is a directory"):
        installed_text.collect([tmp_path / "nope"])
    proc = subprocess.run(
        [sys.executable, "-m", "data.installed_text", str(tmp_path / "c.jsonl"), "--root", "/nope"],
        cwd=REPO, capture_output=True, text=True,
    )
    assert proc.returncode == 1 and proc.stderr.startswith("error: none of the corpus roots")
    assert not (tmp_path / "c.jsonl").exists()


def test_prepare_data_prints_the_dataset_train_py_uses(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"doc {i}: " + BODY}) + "\n" for i in range(60)))
    overrides = ["data=files", f"data.inputs=[{corpus}]", "data.vocab_size=300", "data.val_fraction=0.1",
                 f"data.cache_dir={tmp_path / 'cache'}"]
    proc = subprocess.run([sys.executable, "scripts/prepare_data.py", *overrides], cwd=REPO,
                          capture_output=True, text=True, check=True)
    summary = json.loads(proc.stdout)
    manifest = load_manifest(summary["dir"])
    assert summary["vocab_size"] == 300 and Path(summary["tokenizer"]).is_file()
    assert (summary["train"]["documents"], summary["val"]["documents"]) == (54, 6)
    assert summary["train"]["tokens"] == manifest["splits"]["train"]["tokens"] > 0
    bad = subprocess.run([sys.executable, "scripts/prepare_data.py", "data=files"], cwd=REPO,
                         capture_output=True, text=True)
    assert bad.returncode == 1 and "data.inputs" in bad.stderr and "error:" in bad.stderr
