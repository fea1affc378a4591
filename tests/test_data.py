"""Tests of the data pipeline (data/): tokenizer, prepare (units, parts, kills, format 1), loader,
configs."""

from __future__ import annotations

import gzip
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from omegaconf import OmegaConf

from data import prepare as prep
from data import units
from data.loader import TokenLoader, read_split, sample_order, val_batches
from data.prepare import iter_documents, load_manifest, prepare, prepare_from_config, val_mask
from data.tokenizer import Tokenizer, check_vocab, train_tokenizer

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
import prepare_format1  # noqa: E402

CORPUS = REPO / "data" / "corpus" / "kjv.txt.xz"
VAL_FRACTION = 0.1


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def docs() -> list[str]:
    """The first 40 chapters of the bundled corpus."""
    out = []
    for doc in iter_documents(CORPUS):
        out.append(doc)
        if len(out) == 40:
            return out
    raise AssertionError("the bundled corpus has fewer than 40 documents")


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="module")
def tokenizer(work: Path, docs: list[str]) -> Tokenizer:
    return train_tokenizer(docs, work / "tok512.model", 512)


@pytest.fixture(scope="module")
def txt_file(work: Path, docs: list[str]) -> Path:
    path = work / "small.txt"
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def dataset(work: Path, tokenizer: Tokenizer, txt_file: Path) -> Path:
    return prepare(
        work / "ds",
        tokenizer.path,
        [txt_file],
        val_fraction=VAL_FRACTION,
        num_workers=1,
        progress=False,
    )


def split_tokens(dataset_dir: Path, split: str) -> np.ndarray:
    return read_split(dataset_dir, split)


def decode_documents(tokenizer: Tokenizer, tokens: np.ndarray) -> list[str]:
    assert tokens[-1] == tokenizer.eos_id, "a split must end with EOS"
    ends = np.flatnonzero(tokens == tokenizer.eos_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tokenizer.decode(tokens[a:b]) for a, b in zip(starts, ends, strict=True)]


def expected_splits(docs: list[str], val_fraction: float) -> dict[str, list[str]]:
    is_val = val_mask(np.arange(len(docs)), val_fraction)
    return {
        "train": [d for d, v in zip(docs, is_val, strict=True) if not v],
        "val": [d for d, v in zip(docs, is_val, strict=True) if v],
    }


# ----------------------------------------------------------------------------- tokenizer


def test_tokenizer_roundtrips_any_text(tokenizer: Tokenizer) -> None:
    text = "  Two  spaces,\ttabs,\nnewlines\n\nand ünïcödé — 12345 ✓ "
    ids = tokenizer.encode(text)
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text
    assert (tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id) == (512, 1, 2)


def test_tokenizer_training_is_deterministic(
    tmp_path: Path, docs: list[str], tokenizer: Tokenizer
) -> None:
    again = train_tokenizer(docs, tmp_path / "again.model", 512)
    assert again.sha256 == tokenizer.sha256


def test_missing_and_corrupt_tokenizer(tmp_path: Path, txt_file: Path) -> None:
    missing = tmp_path / "nowhere" / "tokenizer.model"
    with pytest.raises(FileNotFoundError, match=r"nowhere/tokenizer\.model.*tokenizer_path"):
        Tokenizer(missing)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        prepare(tmp_path / "out", missing, [txt_file], progress=False)
    corrupt = tmp_path / "corrupt.model"
    corrupt.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a SentencePiece model"):
        Tokenizer(corrupt)


def test_check_vocab(tokenizer: Tokenizer) -> None:
    check_vocab(tokenizer, 512)
    check_vocab(32000, 32064)
    with pytest.raises(
        ValueError,
        match=r"vocabulary \(512 pieces\) is bigger than the model's "
        r"embedding \(511 rows\)",
    ):
        check_vocab(tokenizer, 511)
    with pytest.raises(ValueError, match="at least 32000"):
        check_vocab(32000, 4096)


# ----------------------------------------------------------------------------- prepare


def test_shards_roundtrip_to_documents(
    dataset: Path, tokenizer: Tokenizer, docs: list[str]
) -> None:
    manifest = load_manifest(dataset)
    expected = expected_splits(docs, VAL_FRACTION)
    assert len(expected["val"]) == 4  # documents 0, 10, 20, 30
    for split, texts in expected.items():
        tokens = split_tokens(dataset, split)
        assert decode_documents(tokenizer, tokens) == texts
        info = manifest["splits"][split]
        assert (info["tokens"], info["documents"]) == (len(tokens), len(texts))
    assert manifest["dtype"] == "uint16"
    assert manifest["vocab_size"] == 512 and manifest["eos_id"] == 2
    assert manifest["tokenizer"] == {"path": str(tokenizer.path), "sha256": tokenizer.sha256}


def test_val_mask_spreads_the_fraction() -> None:
    mask = val_mask(np.arange(1000), 0.01)
    assert mask.sum() == 10
    assert list(np.flatnonzero(mask)) == list(range(0, 1000, 100))
    assert not val_mask(np.arange(100), 0.0).any()


def test_jsonl_and_parquet_inputs_match_txt(
    tmp_path: Path, dataset: Path, docs: list[str], tokenizer: Tokenizer
) -> None:
    lines = "".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs))
    (tmp_path / "a.jsonl").write_text(lines, encoding="utf-8")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt", encoding="utf-8") as fh:
        fh.write(lines)
    pq.write_table(pa.table({"text": docs}), tmp_path / "c.parquet", row_group_size=7)
    reference = load_manifest(dataset)["fingerprint"]
    for name in ("a.jsonl", "b.jsonl.gz", "c.parquet"):
        out = prepare(
            tmp_path / f"ds-{name}",
            tokenizer.path,
            [tmp_path / name],
            val_fraction=VAL_FRACTION,
            num_workers=1,
            progress=False,
        )
        assert load_manifest(out)["fingerprint"] == reference, name


def test_documents_with_blank_lines_roundtrip_via_jsonl(
    tmp_path: Path, tokenizer: Tokenizer
) -> None:
    texts = ["first\n\nwith a blank line", "  indented\ttab  ", "naïve café, 3.14159"]
    (tmp_path / "x.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))
    out = prepare(
        tmp_path / "ds",
        tokenizer.path,
        [tmp_path / "x.jsonl"],
        text_field="body",
        val_fraction=0.0,
        num_workers=1,
        progress=False,
    )
    assert decode_documents(tokenizer, split_tokens(out, "train")) == texts
    assert load_manifest(out)["splits"]["val"] == {"documents": 0, "tokens": 0, "extents": []}


def test_missing_text_field_is_reported(tmp_path: Path, tokenizer: Tokenizer) -> None:
    (tmp_path / "x.jsonl").write_text('{"content": "hello"}\n')
    with pytest.raises(ValueError, match=r"x\.jsonl:1 has no string field 'text'"):
        prepare(tmp_path / "a", tokenizer.path, [tmp_path / "x.jsonl"], progress=False)
    pq.write_table(pa.table({"content": ["hello"]}), tmp_path / "x.parquet")
    with pytest.raises(ValueError, match=r"no column 'text'"):
        prepare(tmp_path / "b", tokenizer.path, [tmp_path / "x.parquet"], progress=False)


@pytest.mark.parametrize("name", ["latin1.txt", "latin1.jsonl"])
def test_non_utf8_input_names_the_file(tmp_path: Path, tokenizer: Tokenizer, name: str) -> None:
    text = "caf\u00e9 au lait\n" if name.endswith(".txt") else '{"text": "caf\u00e9"}\n'
    (tmp_path / name).write_bytes(text.encode("latin-1"))
    with pytest.raises(ValueError, match=rf"{re.escape(str(tmp_path / name))} is not UTF-8 text .*Fix: convert it"):
        prepare(tmp_path / "out", tokenizer.path, [tmp_path / name], progress=False)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_missing_input_and_empty_corpus(tmp_path: Path, tokenizer: Tokenizer) -> None:
    with pytest.raises(FileNotFoundError, match=r"input not found: .*nope\.txt"):
        prepare(tmp_path / "a", tokenizer.path, [tmp_path / "nope.txt"], progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no .txt, .jsonl or .parquet"):
        prepare(tmp_path / "b", tokenizer.path, [tmp_path / "empty"], progress=False)
    (tmp_path / "blank.txt").write_text("\n \n\t\n")
    with pytest.raises(ValueError, match="corpus is empty.*0 tokens"):
        prepare(tmp_path / "c", tokenizer.path, [tmp_path / "blank.txt"], progress=False)
    assert not (tmp_path / "c" / "manifest.json").exists()
    with pytest.raises(ValueError, match="corpus has no text"):
        train_tokenizer(["", "  "], tmp_path / "t.model", 300)


def test_single_document_leaves_train_empty(tmp_path: Path, tokenizer: Tokenizer) -> None:
    (tmp_path / "one.txt").write_text("only one document\n")
    with pytest.raises(ValueError, match="train split is empty.*lower val_fraction"):
        prepare(tmp_path / "a", tokenizer.path, [tmp_path / "one.txt"], progress=False)


def test_second_prepare_reuses_the_dataset(
    work: Path, dataset: Path, tokenizer: Tokenizer, txt_file: Path
) -> None:
    files = sorted(p for p in dataset.rglob("*") if p.is_file() and p.name != ".lock")
    before = {p.name: p.stat().st_mtime_ns for p in files}
    again = prepare(
        work / "ds",
        tokenizer.path,
        [txt_file],
        val_fraction=VAL_FRACTION,
        num_workers=1,
        progress=False,
    )
    assert again == dataset
    assert {p.name: p.stat().st_mtime_ns for p in files} == before
    assert not (dataset / ".incomplete").exists()
    assert not list(dataset.rglob("*.tmp"))


def test_interrupted_prepare_leaves_no_manifest_then_completes(
    tmp_path: Path,
    dataset: Path,
    tokenizer: Tokenizer,
    txt_file: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def crash(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(prep, "_manifest_text", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare(
            tmp_path / "ds",
            tokenizer.path,
            [txt_file],
            val_fraction=VAL_FRACTION,
            num_workers=1,
            progress=False,
        )
    assert (tmp_path / "ds" / "units" / "000000.bin").exists()
    assert (tmp_path / "ds" / "ledger" / "000000.json").exists()
    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        TokenLoader(tmp_path / "ds", "train", seq_len=8, global_batch_size=2)
    monkeypatch.undo()
    out = prepare(
        tmp_path / "ds",
        tokenizer.path,
        [txt_file],
        val_fraction=VAL_FRACTION,
        num_workers=1,
        progress=False,
    )
    assert load_manifest(out)["fingerprint"] == load_manifest(dataset)["fingerprint"]
    assert not (out / ".incomplete").exists()


def test_damaged_shard_is_detected_and_rebuilt(
    tmp_path: Path, dataset: Path, tokenizer: Tokenizer, txt_file: Path
) -> None:
    kwargs = dict(val_fraction=VAL_FRACTION, num_workers=1, progress=False)
    out = prepare(tmp_path / "ds", tokenizer.path, [txt_file], **kwargs)
    unit = out / "units" / "000000.bin"
    unit.write_bytes(unit.read_bytes()[:-2])
    with pytest.raises(ValueError, match=r"units/000000\.bin is .* bytes; the manifest expects"):
        TokenLoader(out, "val", seq_len=8, global_batch_size=2)
    unit.unlink()
    with pytest.raises(FileNotFoundError, match=r"units/000000\.bin of the manifest is missing"):
        TokenLoader(out, "train", seq_len=8, global_batch_size=2)
    prepare(tmp_path / "ds", tokenizer.path, [txt_file], **kwargs)
    assert load_manifest(out)["fingerprint"] == load_manifest(dataset)["fingerprint"]
    TokenLoader(out, "val", seq_len=8, global_batch_size=2)
    TokenLoader(out, "train", seq_len=8, global_batch_size=2)


def test_prepare_never_overwrites_other_data(
    tmp_path: Path, dataset: Path, tokenizer: Tokenizer, txt_file: Path
) -> None:
    with pytest.raises(ValueError, match="already holds a dataset prepared from other"):
        prepare(dataset, tokenizer.path, [txt_file], val_fraction=0.5, progress=False)
    assert load_manifest(dataset)["recipe"]["val_fraction"] == VAL_FRACTION
    user_dir = tmp_path / "mine"
    user_dir.mkdir()
    (user_dir / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not empty and holds no dataset"):
        prepare(user_dir, tokenizer.path, [txt_file], progress=False)
    assert os.listdir(user_dir) == ["notes.txt"]
    assert (user_dir / "notes.txt").read_text() == "keep me"


def test_workers_and_max_tokens_do_not_change_tokens(
    tmp_path: Path,
    dataset: Path,
    tokenizer: Tokenizer,
    txt_file: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(prep, "_CHUNK_CHARS", 5000)  # many chunks, so order across workers counts
    out = prepare(
        tmp_path / "pool",
        tokenizer.path,
        [txt_file],
        val_fraction=VAL_FRACTION,
        num_workers=2,
        progress=False,
    )
    manifest = load_manifest(out)
    assert manifest["format_version"] == prep.FORMAT_VERSION == 2
    assert len(manifest["splits"]["val"]["extents"]) == 4  # documents 0, 10, 20, 30
    for split in ("train", "val"):
        assert np.array_equal(split_tokens(out, split), split_tokens(dataset, split))
    assert manifest["fingerprint"] == load_manifest(dataset)["fingerprint"]
    capped = prepare(
        tmp_path / "capped",
        tokenizer.path,
        [txt_file],
        val_fraction=VAL_FRACTION,
        max_tokens=5000,
        num_workers=2,
        progress=False,
    )
    info = load_manifest(capped)["splits"]
    total = info["train"]["tokens"] + info["val"]["tokens"]
    kept = info["train"]["documents"] + info["val"]["documents"]
    lengths = [len(tokenizer.encode(d)) + 1 for d in iter_documents(txt_file)]
    assert total == sum(lengths[:kept]) and sum(lengths[: kept - 1]) < 5000 <= total


def test_cli_trains_the_tokenizer_on_the_train_split(
    tmp_path: Path, txt_file: Path, docs: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    out = prep.main(
        [
            str(txt_file),
            "--out",
            str(tmp_path / "cli"),
            "--vocab-size",
            "512",
            "--val-fraction",
            str(VAL_FRACTION),
            "--num-workers",
            "1",
            "--quiet",
        ]
    )
    assert "vocab_size 512" in capsys.readouterr().out
    train_only = train_tokenizer(
        expected_splits(docs, VAL_FRACTION)["train"], tmp_path / "train_only.model", 512
    )
    assert Tokenizer(out / "tokenizer.model").sha256 == train_only.sha256
    with pytest.raises(SystemExit):
        prep.main([str(txt_file), "--out", str(tmp_path / "x")])  # neither tokenizer nor vocab


# ----------------------------------------------------------------------------- units, parts, kills

MULTI_FILES = 6
MULTI_VAL_FRACTION = 0.02


@pytest.fixture(scope="module")
def corpus_dir(work: Path) -> Path:
    """The bundled corpus (1,189 chapters) split into 6 .txt files of consecutive chapters."""
    chapters = list(iter_documents(CORPUS))
    folder = work / "corpus6"
    folder.mkdir()
    step = -(-len(chapters) // MULTI_FILES)
    for i in range(MULTI_FILES):
        text = "\n\n".join(chapters[i * step : (i + 1) * step]) + "\n"
        (folder / f"part{i}.txt").write_text(text, encoding="utf-8")
    return folder


def prepare_args(tokenizer: Tokenizer, corpus_dir: Path, out: Path) -> list[str]:
    """``python -m data.prepare`` arguments that prepare ``corpus_dir`` into ``out``."""
    return [str(corpus_dir), "--out", str(out), "--tokenizer", str(tokenizer.path),
            "--val-fraction", str(MULTI_VAL_FRACTION), "--quiet"]


@pytest.fixture(scope="module")
def multi_reference(work: Path, tokenizer: Tokenizer, corpus_dir: Path) -> Path:
    """The 6-file corpus prepared in one uninterrupted call with one worker."""
    return prepare(work / "multi-ref", tokenizer.path, [corpus_dir], val_fraction=MULTI_VAL_FRACTION,
                   num_workers=1, progress=False)


def dataset_files(out: Path) -> dict[str, bytes]:
    """Every file of a dataset directory but its lock, by relative path: its bytes."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.name != ".lock"}


def assert_same_dataset(out: Path, reference: Path) -> None:
    got, want = dataset_files(out), dataset_files(reference)
    assert sorted(got) == sorted(want)
    differing = [name for name in want if got[name] != want[name]]
    assert not differing, f"files of {out} differ from {reference}: {differing}"


def run_prepare(args: list[str]) -> subprocess.Popen:
    """``python -m data.prepare ARGS`` in a session of its own (so its pool can be killed with it)."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen([sys.executable, "-m", "data.prepare", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def test_multi_file_dataset_matches_format1(
    tmp_path: Path, multi_reference: Path, tokenizer: Tokenizer, corpus_dir: Path
) -> None:
    """Format 2 (one unit per file) holds the token streams of format 1 (one stream cut into
    shards): the same documents in the same order, the same validation documents, the same
    fingerprint; also when ``max_tokens`` cuts inside the third file."""
    manifest = load_manifest(multi_reference)
    assert len(manifest["units"]) == MULTI_FILES and manifest["format_version"] == 2
    old = prepare_format1.prepare(tmp_path / "v1", tokenizer.path, [corpus_dir],
                                  val_fraction=MULTI_VAL_FRACTION, num_workers=1, progress=False,
                                  shard_tokens=50_000)
    assert load_manifest(old)["fingerprint"] == manifest["fingerprint"]
    for split in ("train", "val"):
        assert np.array_equal(read_split(old, split), read_split(multi_reference, split))
        assert manifest["splits"][split]["documents"] == load_manifest(old)["splits"][split]["documents"]
    cut = manifest["units"][0]["tokens"] + manifest["units"][1]["tokens"] + 1000
    kwargs = dict(val_fraction=MULTI_VAL_FRACTION, max_tokens=cut, num_workers=1, progress=False)
    capped_old = prepare_format1.prepare(tmp_path / "v1cap", tokenizer.path, [corpus_dir], **kwargs)
    capped = prepare(tmp_path / "cap", tokenizer.path, [corpus_dir], **kwargs)
    assert load_manifest(capped)["fingerprint"] == load_manifest(capped_old)["fingerprint"]
    assert sorted(p.name for p in (capped / "units").glob("*.bin")) == ["000000.bin", "000001.bin", "000002.bin"]


def test_format1_dataset_is_kept_and_its_runs_resume(
    tmp_path: Path, tokenizer: Tokenizer, txt_file: Path, dataset: Path
) -> None:
    """A dataset written by format 1's preparation is read as it is, prepare() returns it
    untouched, and a loader state saved on it resumes on the format-2 dataset of the same inputs
    with the same batches (and the reverse)."""
    kwargs = dict(val_fraction=VAL_FRACTION, num_workers=1, progress=False)
    old = prepare_format1.prepare(tmp_path / "v1", tokenizer.path, [txt_file], shard_tokens=3000, **kwargs)
    before = dataset_files(old)
    assert load_manifest(old)["format_version"] == 1 and len(load_manifest(old)["splits"]["train"]["shards"]) > 3
    assert prepare(old, tokenizer.path, [txt_file], **kwargs) == old
    assert dataset_files(old) == before
    with pytest.raises(ValueError, match="already holds a dataset prepared from other"):
        prepare(old, tokenizer.path, [txt_file], val_fraction=0.5, progress=False)
    saved = TokenLoader(old, "train", 64, 6, seed=5)
    batches(saved, 7)
    state = saved.state_dict()
    for directory in (old, dataset):
        resumed = TokenLoader(directory, "train", 64, 6, seed=0)
        resumed.load_state_dict(state)
        for (x, y), (rx, ry) in zip(batches(resumed, 5), batches(TokenLoader(old, "train", 64, 6, seed=5), 12)[7:],
                                    strict=True):
            assert torch.equal(x, rx) and torch.equal(y, ry)
    assert [x.tolist() for x, _ in val_batches(old, 16, 2)] == [x.tolist() for x, _ in val_batches(dataset, 16, 2)]
    (old / "train_000001.bin").unlink()  # damaged: prepared again, as format 2, same streams
    assert prepare(old, tokenizer.path, [txt_file], **kwargs) == old
    assert load_manifest(old)["format_version"] == 2
    assert load_manifest(old)["fingerprint"] == json.loads(before["manifest.json"])["fingerprint"]
    assert not list(old.glob("train_*.bin"))


def test_format1_cache_directory_is_found_by_the_config(tmp_path: Path, txt_file: Path) -> None:
    """A dataset that format 1 prepared from a config lives in the directory that the config
    names today, so a run resumed with that config finds it, unchanged."""
    cfg = load_config("sample", tmp_path, inputs=[str(txt_file)], vocab_size=512, num_workers=1)
    old = prepare_format1.prepare_from_config(cfg)
    before = dataset_files(old)
    assert prep.dataset_dir(cfg) == old
    assert prepare_from_config(cfg) == old
    assert dataset_files(old) == before


def writing(out: Path, pid: int) -> bool:
    """Whether process ``pid`` is writing a unit of ``out`` (its temporary files exist)."""
    return any((out / "units").glob(f".*.{pid}.tmp")) if (out / "units").is_dir() else False


def test_sigkilled_preparation_resumes_to_the_same_bytes(
    tmp_path: Path, multi_reference: Path, tokenizer: Tokenizer, corpus_dir: Path
) -> None:
    """SIGKILL (the process and its pool) at random points of its work, run again, until it
    finishes: the directory is byte-identical to an uninterrupted one-worker preparation."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    out = tmp_path / "killed"
    args = prepare_args(tokenizer, corpus_dir, out) + ["--num-workers", "2"]
    finished_at_kill: list[int] = []
    longest = 3.0  # seconds from the first unit's start to the kill, at most
    for _attempt in range(10):
        proc = run_prepare(args)
        deadline = time.monotonic() + 120
        while proc.poll() is None and not writing(out, proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)  # until it tokenizes its first unit
        time.sleep(rng.uniform(0, longest))
        if proc.poll() is not None and not finished_at_kill:  # finished before any kill: again
            proc.wait()
            shutil.rmtree(out)
            longest /= 2
            continue
        if proc.poll() is not None:
            break
        finished_at_kill.append(len(list((out / "ledger").glob("*.json"))))
        os.killpg(proc.pid, signal.SIGKILL)  # the session started for this process
        proc.wait()
    else:
        proc = run_prepare(args)
        proc.wait(timeout=300)
    assert proc.returncode == 0, f"seed {seed}: {proc.stderr.read()}"
    assert finished_at_kill, f"seed {seed}: no attempt was killed"
    assert_same_dataset(out, multi_reference)
    print(f"seed {seed}: {len(finished_at_kill)} kill(s), units finished at each: {finished_at_kill}")


def test_two_processes_prepare_disjoint_parts(
    tmp_path: Path, multi_reference: Path, tokenizer: Tokenizer, corpus_dir: Path
) -> None:
    """``--part 0/2`` and ``--part 1/2`` at once on one directory: the part finishing last runs
    the final step, and the result is byte-identical to one process's."""
    out = tmp_path / "parts"
    procs = [run_prepare(prepare_args(tokenizer, corpus_dir, out) + ["--num-workers", "1", "--part", f"{k}/2"])
             for k in range(2)]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert sum("unit(s) unfinished" in o for o, _ in outputs) <= 1, outputs
    assert_same_dataset(out, multi_reference)


def test_final_step_names_unfinished_missing_and_corrupt_units(
    tmp_path: Path, multi_reference: Path, tokenizer: Tokenizer, corpus_dir: Path
) -> None:
    out = tmp_path / "ds"
    kwargs = dict(val_fraction=MULTI_VAL_FRACTION, num_workers=1, progress=False)
    prepare(out, tokenizer.path, [corpus_dir], part=(0, 2), **kwargs)
    assert not (out / "manifest.json").exists()
    with pytest.raises(units.UnitError, match=r"needs 3 unfinished unit\(s\).*3 \(.*part3\.txt\), 4 .*, 5 "):
        prepare(out, tokenizer.path, [corpus_dir], tokenize=False, **kwargs)
    (out / "units" / "000001.bin").unlink()
    with pytest.raises(units.UnitError, match=r"unit 1 \(.*part1\.txt\) is damaged: .*units/000001\.bin is missing"):
        prepare(out, tokenizer.path, [corpus_dir], part=(1, 2), **kwargs)
    assert not (out / "ledger" / "000001.json").exists()  # so that the next run redoes it
    blob = bytearray((out / "units" / "000004.bin").read_bytes())
    blob[100] ^= 1  # same size, other bytes: only the final step's SHA-256 finds it
    (out / "units" / "000004.bin").write_bytes(bytes(blob))
    with pytest.raises(units.UnitError, match=r"unit 4 \(.*part4\.txt\) is damaged: .*000004\.bin does not hold"):
        prepare(out, tokenizer.path, [corpus_dir], **kwargs)
    assert prepare(out, tokenizer.path, [corpus_dir], **kwargs) == out
    assert_same_dataset(out, multi_reference)


def test_parts_past_max_tokens_leave_the_same_dataset(
    tmp_path: Path, multi_reference: Path, tokenizer: Tokenizer, corpus_dir: Path
) -> None:
    """With ``max_tokens`` inside the third file, the second part (files 3 to 5, all past it) is
    tokenized before the first part finishes; the final step removes those units, and the result
    is the single process's, which never tokenized them."""
    cut = sum(u["tokens"] for u in load_manifest(multi_reference)["units"][:2]) + 1000
    kwargs = dict(val_fraction=MULTI_VAL_FRACTION, max_tokens=cut, num_workers=1, progress=False)
    single = prepare(tmp_path / "single", tokenizer.path, [corpus_dir], **kwargs)
    assert len(list((single / "ledger").glob("*.json"))) == 3
    out = tmp_path / "parts"
    prepare(out, tokenizer.path, [corpus_dir], part=(1, 2), **kwargs)
    assert len(list((out / "units").glob("*.bin"))) == 3 and not (out / "manifest.json").exists()
    prepare(out, tokenizer.path, [corpus_dir], part=(0, 2), **kwargs)
    assert_same_dataset(out, single)
    units.write_json(units.record_path(out, 5), {"unit": 5})  # what a late part may leave
    assert prepare(out, tokenizer.path, [corpus_dir], part=(1, 2), **kwargs) == out
    assert_same_dataset(out, single)


def test_parts_must_share_the_recipe(
    tmp_path: Path, tokenizer: Tokenizer, corpus_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "ds"
    prepare(out, tokenizer.path, [corpus_dir], val_fraction=0.02, part=(0, 3), num_workers=1, progress=False)
    with pytest.raises(ValueError, match="being prepared from other inputs.*same inputs and settings"):
        prepare(out, tokenizer.path, [corpus_dir], val_fraction=0.05, part=(1, 3), progress=False)
    with pytest.raises(ValueError, match="part must be K/N with 0 <= K < N, got 3/3"):
        prepare(out, tokenizer.path, [corpus_dir], val_fraction=0.02, part=(3, 3), progress=False)
    with pytest.raises(SystemExit):
        prep.main([str(corpus_dir), "--out", str(out), "--tokenizer", str(tokenizer.path), "--part", "x"])
    assert "'x' is not K/N, e.g. 0/8" in capsys.readouterr().err


def test_sample_order_is_the_permutation() -> None:
    """The loader's uint32 order is numpy's ``permutation``: runs keep their order."""
    for n, seed, epoch in ((1, 0, 0), (7, 3, 1), (1000, 0, 5), (123_457, 42, 2)):
        order = sample_order(seed, epoch, n)
        assert order.dtype == np.uint32
        assert np.array_equal(order, np.random.default_rng((seed, epoch)).permutation(n))
    assert not np.array_equal(sample_order(0, 0, 1000), sample_order(0, 1, 1000))


# ----------------------------------------------------------------------------- configs


def load_config(name: str, tmp_path: Path, **overrides: object) -> OmegaConf:
    cfg = OmegaConf.load(REPO / "configs" / "data" / f"{name}.yaml")
    return OmegaConf.merge(cfg, {"cache_dir": str(tmp_path / "cache"), **overrides})


def test_sample_config_prepares_the_bundled_corpus(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m data.prepare --config configs/data/sample.yaml`` prints docs/data.md's line."""
    cfg = load_config("sample", tmp_path, num_workers=1)
    out = prep.main(["--config", str(REPO / "configs" / "data" / "sample.yaml"),
                     "--set", f"cache_dir={cfg.cache_dir}", "--set", "num_workers=1"])
    doc = (REPO / "docs" / "data.md").read_text(encoding="utf-8")
    documented = re.search(r"^# /path/to/repo/data/cache/sample-<key>: (.*)$", doc, re.M)
    assert documented and capsys.readouterr().out == f"{out}: {documented.group(1)}\n"
    assert out.parent == tmp_path / "cache" and out.name.startswith("sample-")
    manifest = load_manifest(out)
    assert manifest["vocab_size"] == cfg.vocab_size == 4096
    assert manifest["splits"]["val"]["documents"] == 12  # 1% of the 1,189 chapters
    assert manifest["splits"]["train"]["tokens"] > 1_000_000
    assert prepare_from_config(cfg) == out
    assert load_manifest(out) == manifest


def test_config_vocab_mismatch_and_missing_tokenizer(
    tmp_path: Path, tokenizer: Tokenizer, txt_file: Path
) -> None:
    cfg = load_config(
        "sample", tmp_path, inputs=[str(txt_file)], tokenizer_path=str(tokenizer.path)
    )
    with pytest.raises(ValueError, match="data.vocab_size is 4096 .* Set data.vocab_size=512"):
        prepare_from_config(cfg)
    cfg.tokenizer_path = str(tmp_path / "llama" / "tokenizer.model")
    with pytest.raises(FileNotFoundError, match=r"llama/tokenizer\.model"):
        prepare_from_config(cfg)


def test_c4_without_tokenizer_path_names_the_fix(tmp_path: Path, compose_train) -> None:
    """``python train.py data=c4`` without ``data.tokenizer_path``: the config train.py composes
    gives a ValueError (train.py prints it as one line) naming both fixes, before anything is
    written; so does the config file read by ``python -m data.prepare --config``."""
    cfg = compose_train(["data=c4", f"data.cache_dir={tmp_path / 'cache'}"]).data
    assert OmegaConf.is_missing(cfg, "tokenizer_path")
    fixes = (
        r"data\.tokenizer_path is not set.*Fix: add data\.tokenizer_path=/path/to/llama-2/tokenizer\.model "
        r"to the train\.py command, or prepare the dataset ahead: python -m data\.prepare --config "
        r"configs/data/c4\.yaml --set tokenizer_path=/path/to/llama-2/tokenizer\.model$"
    )
    with pytest.raises(ValueError, match=fixes):
        prepare_from_config(cfg)
    with pytest.raises(ValueError, match=fixes):
        prep.main(["--config", str(REPO / "configs" / "data" / "c4.yaml"), "--set", f"cache_dir={tmp_path / 'cache'}"])
    assert not (tmp_path / "cache").exists()


def test_c4_config_streams_a_hf_dataset(
    tmp_path: Path, tokenizer: Tokenizer, docs: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []

    def load_dataset(path: str, name: str, split: str, streaming: bool) -> list[dict]:
        calls.append((path, name, split, streaming))
        return [{"text": d, "url": "x"} for d in docs]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    cfg = load_config(
        "c4",
        tmp_path,
        tokenizer_path=str(tokenizer.path),
        vocab_size=512,
        val_fraction=VAL_FRACTION,
        num_workers=1,
    )
    out = prepare_from_config(cfg)
    assert calls == [("allenai/c4", "en", "train", True)]
    for split, texts in expected_splits(docs, VAL_FRACTION).items():
        assert decode_documents(tokenizer, split_tokens(out, split)) == texts
    assert prepare_from_config(cfg) == out and len(calls) == 1  # reused: no second download
    monkeypatch.setitem(sys.modules, "datasets", None)  # once prepared, no Hub access is needed
    assert prepare_from_config(cfg) == out


def test_hf_errors_without_datasets_or_network(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match="pip install datasets"):
        prep.iter_hf_documents("allenai/c4", "en")

    def offline(*args: object, **kwargs: object) -> None:
        raise OSError("name resolution failed")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    with pytest.raises(ConnectionError, match="name resolution failed.*network access"):
        prep.iter_hf_documents("allenai/c4", "en")


# ----------------------------------------------------------------------------- loader


def batches(loader: TokenLoader, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [loader.next_batch() for _ in range(count)]


def test_batches_are_shifted_windows_in_shuffled_order(dataset: Path) -> None:
    seq_len = 64
    stream = split_tokens(dataset, "train").astype(np.int64)
    loader = TokenLoader(dataset, "train", seq_len, global_batch_size=1)
    n = loader.num_samples
    assert n == (len(stream) - 1) // seq_len
    windows = {tuple(stream[i * seq_len : i * seq_len + seq_len + 1]) for i in range(n)}
    loader = TokenLoader(dataset, "train", seq_len, global_batch_size=n)
    for _ in range(2):  # two epochs, in two different orders
        inputs, targets = loader.next_batch()
        assert inputs.dtype == targets.dtype == torch.long
        assert inputs.shape == targets.shape == (n, seq_len)
        assert torch.equal(inputs[:, 1:], targets[:, :-1])
        rows = torch.cat([inputs, targets[:, -1:]], dim=1).numpy()
        assert {tuple(r) for r in rows} == windows
        assert not np.array_equal(rows[:, 0], stream[np.arange(n) * seq_len])
    assert loader.state_dict()["epoch"] == 2


def test_loader_resumes_at_the_same_token(dataset: Path) -> None:
    args = (dataset, "train", 128, 24)
    reference = batches(TokenLoader(*args, seed=3), 30)  # crosses epoch boundaries
    first = TokenLoader(*args, seed=3)
    batches(first, 11)
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint as plain data
    resumed = TokenLoader(*args, seed=99)
    resumed.load_state_dict(state)
    assert resumed.seed == 3
    for (x, y), (rx, ry) in zip(batches(resumed, 19), reference[11:], strict=True):
        assert torch.equal(x, rx) and torch.equal(y, ry)
    other_seed = batches(TokenLoader(*args, seed=4), 1)[0][0]
    assert not torch.equal(other_seed, reference[0][0])


def test_two_ranks_see_the_single_rank_batches(dataset: Path) -> None:
    single = TokenLoader(dataset, "train", 32, 8, seed=1)
    ranks = [TokenLoader(dataset, "train", 32, 8, rank=r, world_size=2, seed=1) for r in range(2)]
    for _ in range(3):
        x, y = single.next_batch()
        parts = [rank.next_batch() for rank in ranks]
        assert parts[0][0].shape == (4, 32)
        assert torch.equal(torch.cat([p[0] for p in parts]), x)
        assert torch.equal(torch.cat([p[1] for p in parts]), y)
    assert ranks[0].state_dict() == ranks[1].state_dict() == single.state_dict()
    resumed = TokenLoader(dataset, "train", 32, 8, rank=1, world_size=2)
    resumed.load_state_dict(single.state_dict())
    assert torch.equal(resumed.next_batch()[0], single.next_batch()[0][4:])


def test_changed_fingerprint_is_refused(
    tmp_path: Path, dataset: Path, tokenizer: Tokenizer, txt_file: Path
) -> None:
    other = prepare(
        tmp_path / "other",
        tokenizer.path,
        [txt_file],
        val_fraction=0.2,
        num_workers=1,
        progress=False,
    )
    state = TokenLoader(dataset, "train", 16, 4).state_dict()
    loader = TokenLoader(other, "train", 16, 4)
    assert loader.fingerprint != state["fingerprint"]
    with pytest.raises(ValueError, match=f"{state['fingerprint']}.*{loader.fingerprint}"):
        loader.load_state_dict(state)
    with pytest.raises(ValueError, match="seq_len=16"):
        TokenLoader(dataset, "train", 32, 4).load_state_dict(state)


def test_loader_errors(dataset: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a positive multiple of world_size 4"):
        TokenLoader(dataset, "train", 16, 6, rank=0, world_size=4)
    with pytest.raises(ValueError, match="fewer than one sample .*larger val_fraction"):
        TokenLoader(dataset, "val", 10**6, 2)
    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        TokenLoader(tmp_path, "train", 16, 2)


def test_val_batches_are_fixed(dataset: Path) -> None:
    first = list(val_batches(dataset, 32, 4, num_batches=3))
    second = list(val_batches(dataset, 32, 4, num_batches=3))
    assert len(first) == 3 and all(x.shape == (4, 32) for x, _ in first)
    for (x, y), (x2, y2) in zip(first, second, strict=True):
        assert torch.equal(x, x2) and torch.equal(y, y2)
    ranks = [list(val_batches(dataset, 32, 4, 3, rank=r, world_size=2)) for r in range(2)]
    for i, (x, y) in enumerate(first):
        assert torch.equal(torch.cat([ranks[0][i][0], ranks[1][i][0]]), x)
        assert torch.equal(torch.cat([ranks[0][i][1], ranks[1][i][1]]), y)
    stream = split_tokens(dataset, "val").astype(np.int64)
    every = list(val_batches(dataset, 32, 4))
    assert len(every) == ((len(stream) - 1) // 32) // 4
    assert np.array_equal(every[0][0][0].numpy(), stream[:32])
    with pytest.raises(ValueError, match="asked for 1000 validation batches"):
        val_batches(dataset, 32, 4, num_batches=1000)
