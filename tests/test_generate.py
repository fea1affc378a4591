"""Tests of model/sampling.py and scripts/generate.py on a tiny random model (CPU, max_seq_len 8 so
that generation runs past the context window), and of the command line on a consolidated .pt, a
DCP run directory and a tokenizer trained on a few chapters of the bundled corpus."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from data.prepare import dataset_dir, iter_documents, prepare_from_config
from inference.trained_model import model_from_state
from model.llama import Llama, build_model
from model.sampling import generate
from scripts.generate import main
from training.checkpoint import Checkpointer

REPO = Path(__file__).resolve().parents[1]
MODEL_CFG = {"name": "micro", "vocab_size": 384, "n_layer": 2, "d_model": 64, "n_head": 2, "max_seq_len": 8}
PROMPT = [5, 17, 42, 99, 3]
LONG_PROMPT = list(range(10, 22))  # 12 tokens, longer than max_seq_len

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def model() -> Llama:
    torch.manual_seed(0)
    return build_model(MODEL_CFG).eval()


def windowed_logits(model: Llama, ids: list[int]) -> torch.Tensor:
    """Last-position logits of the full forward over the last max_seq_len tokens of ``ids``."""
    with torch.no_grad():
        return model(torch.tensor([ids[-model.config.max_seq_len:]]))[0, -1]


# ----------------------------------------------------------------------------- model.sampling


@pytest.mark.parametrize("prompt", [PROMPT, LONG_PROMPT])
def test_greedy_is_the_argmax_of_the_full_forward_at_every_step(model: Llama, prompt: list[int]) -> None:
    new = generate(model, prompt, 20, temperature=0)
    assert len(new) == 20 and len(prompt) + len(new) > 2 * model.config.max_seq_len
    for i, token in enumerate(new):
        assert token == int(windowed_logits(model, prompt + new[:i]).argmax()), f"step {i}"


def test_a_fixed_seed_repeats_and_another_seed_differs(model: Llama) -> None:
    # At temperature 1 a random model's next-token distribution is close to uniform over 384
    # tokens, so two seeds giving the same 20 tokens has a chance of roughly 384**-20.
    first = generate(model, PROMPT, 20, temperature=1.0, seed=1)
    assert generate(model, PROMPT, 20, temperature=1.0, seed=1) == first
    assert generate(model, PROMPT, 20, temperature=1.0, seed=2) != first
    assert len(first) == 20 and all(0 <= t < MODEL_CFG["vocab_size"] for t in first)


def test_top_k_1_is_greedy_and_top_k_keeps_the_k_most_likely(model: Llama) -> None:
    greedy = generate(model, LONG_PROMPT, 20, temperature=0)
    assert generate(model, LONG_PROMPT, 20, temperature=1.5, top_k=1, seed=7) == greedy
    new = generate(model, PROMPT, 20, temperature=2.0, top_k=3, seed=3)
    for i, token in enumerate(new):
        assert token in windowed_logits(model, PROMPT + new[:i]).topk(3).indices.tolist(), f"step {i}"


def test_generation_stops_after_eos(model: Llama) -> None:
    free = generate(model, PROMPT, 20, temperature=1.0, seed=4)
    stop = free.index(free[5])  # the first occurrence of the token drawn at step 5
    assert generate(model, PROMPT, 20, temperature=1.0, seed=4, eos_id=free[5]) == free[:stop + 1]
    assert generate(model, PROMPT, 0) == []


@pytest.mark.parametrize("kwargs, message", [
    ({"prompt_ids": []}, "prompt is empty"),
    ({"max_new_tokens": -1}, "max_new_tokens must be >= 0"),
    ({"temperature": -0.5}, "temperature must be >= 0"),
    ({"top_k": 0}, "top_k must be >= 1"),
])
def test_bad_arguments_are_value_errors(model: Llama, kwargs: dict, message: str) -> None:
    args = {"prompt_ids": PROMPT, "max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        generate(model, **args)


# ----------------------------------------------------------------------------- scripts/generate.py


@pytest.fixture(scope="module")
def data_cfg(tmp_path_factory: pytest.TempPathFactory):
    """A data config group over 30 chapters of the bundled corpus, prepared (tokenizer of 384
    pieces trained into its dataset directory) in a temporary cache."""
    work = tmp_path_factory.mktemp("generate")
    docs = [doc for _, doc in zip(range(30), iter_documents(REPO / "data" / "corpus" / "kjv.txt.xz"))]
    (work / "corpus.txt").write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    cfg = OmegaConf.create({
        "name": "gen", "inputs": [str(work / "corpus.txt")], "hf_dataset": None, "text_field": "text",
        "tokenizer_path": None, "vocab_size": 384, "val_fraction": 0.1, "max_tokens": None,
        "num_workers": 1, "cache_dir": str(work / "cache"),
    })
    assert prepare_from_config(cfg) == dataset_dir(cfg)
    return cfg


@pytest.fixture(scope="module")
def tokenizer_path(data_cfg) -> Path:
    return dataset_dir(data_cfg) / "tokenizer.model"


def save_consolidated(model: Llama, path: Path, data: dict | None) -> Path:
    """Write ``model`` as scripts/export_checkpoint.py does: {"model", "config", "step"}."""
    config = {"model": MODEL_CFG} | ({"data": data} if data is not None else {})
    torch.save({"model": model.state_dict(), "config": config, "step": 7}, path)
    return path


@pytest.fixture(scope="module")
def consolidated(model: Llama, data_cfg, tmp_path_factory: pytest.TempPathFactory) -> Path:
    data = OmegaConf.to_container(data_cfg)
    return save_consolidated(model, tmp_path_factory.mktemp("ckpt") / "model.pt", data)


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


SAMPLE = ("--prompt", "In the beginning God created", "--max-new-tokens", "20", "--seed", "3",
          "--num-samples", "2", "--device", "cpu")


def samples(out: str) -> list[str]:
    """The sample texts of the CLI's stdout, without their header lines."""
    return re.split(r"^--- sample \d+/\d+ \(seed \d+\) ---\n", out, flags=re.M)[1:]


def test_cli_prints_the_same_samples_for_a_fixed_seed(
    consolidated: Path, tokenizer_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, _ = cli(capsys, str(consolidated), *SAMPLE, "--tokenizer", str(tokenizer_path))
    assert status == 0
    assert out.startswith("--- sample 1/2 (seed 3) ---\n") and "\n--- sample 2/2 (seed 4) ---\n" in out
    first, second = samples(out)
    assert first.startswith("In the beginning God created") and second.startswith("In the beginning God created")
    assert first != second
    # Without --tokenizer, the run config's prepared dataset supplies the same tokenizer.
    assert cli(capsys, str(consolidated), *SAMPLE)[:2] == (0, out)
    # A fresh process prints the same.
    script = subprocess.run([sys.executable, str(REPO / "scripts" / "generate.py"), str(consolidated), *SAMPLE],
                            capture_output=True, text=True, timeout=120)
    assert (script.returncode, script.stdout) == (0, out), script.stderr
    status, other, _ = cli(capsys, str(consolidated), *SAMPLE, "--seed", "5")
    assert status == 0 and samples(other)[0] not in (first, second)


def test_cli_greedy_matches_generate(
    model: Llama, consolidated: Path, tokenizer_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from data.tokenizer import Tokenizer

    tok = Tokenizer(tokenizer_path)
    prompt = tok.encode("And God said")
    expected = tok.decode(prompt + generate(model, [tok.eos_id, *prompt], 12, temperature=0, eos_id=tok.eos_id))
    status, out, _ = cli(capsys, str(consolidated), "--prompt", "And God said", "--temperature", "0",
                         "--max-new-tokens", "12", "--device", "cpu")
    assert status == 0 and out.splitlines()[1:] == expected.splitlines()


def test_cli_reads_a_run_directory_like_its_consolidated_export(
    model: Llama, data_cfg, consolidated: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = {"model": MODEL_CFG, "data": OmegaConf.to_container(data_cfg)}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    Checkpointer(tmp_path / "run" / "checkpoints").save(7, model, optimizer, {"step": 7, "config": config})
    status, out, err = cli(capsys, str(tmp_path / "run"), *SAMPLE)
    assert status == 0 and "step_00000007" in err
    assert out == cli(capsys, str(consolidated), *SAMPLE)[1]


def test_cli_errors_are_one_line(
    model: Llama, consolidated: Path, tokenizer_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def error(*argv: str) -> str:
        status, out, err = cli(capsys, *argv, "--device", "cpu")
        assert status == 1 and out == "" and err.startswith("error: ") and err.count("\n") == 1, err
        return err

    (tmp_path / "notes.txt").write_text("not a checkpoint")
    (tmp_path / "empty").mkdir()
    assert "is not a consolidated checkpoint" in error(str(tmp_path / "notes.txt"), "--prompt", "x")
    assert "is neither a checkpoint" in error(str(tmp_path / "empty"), "--prompt", "x")
    assert "Nor is it an exported Hugging Face folder" in error(str(tmp_path / "empty"), "--prompt", "x")
    assert "does not exist" in error(str(tmp_path / "typo.pt"), "--prompt", "x")
    bare = save_consolidated(model, tmp_path / "bare.pt", None)
    assert "--tokenizer" in error(str(bare), "--prompt", "x")
    lost = save_consolidated(model, tmp_path / "lost.pt", {"tokenizer_path": str(tmp_path / "gone.model")})
    err = error(str(lost), "--prompt", "x")
    assert "gone.model does not exist" in err and "--tokenizer" in err
    assert "--tokenizer /nowhere.model does not exist" in error(str(consolidated), "--prompt", "x",
                                                                 "--tokenizer", "/nowhere.model")
    assert "prompt is empty" in error(str(consolidated), "--prompt", "", "--tokenizer", str(tokenizer_path))


def test_quantizer_buffers_are_left_out_and_a_missing_weight_is_an_error(model: Llama) -> None:
    weights = model.state_dict()
    state = {"model": weights | {"blocks.0.attn.qkv.delayed_amax": torch.zeros(6)}, "config": {"model": MODEL_CFG}}
    loaded = model_from_state(state, torch.device("cpu"))
    assert torch.equal(windowed_logits(loaded, PROMPT), windowed_logits(model, PROMPT))
    state["model"] = {k: v for k, v in weights.items() if k != "lm_head.weight"}
    with pytest.raises(ValueError, match=r"missing \['lm_head.weight'\]"):
        model_from_state(state, torch.device("cpu"))


def test_cli_reads_an_exported_hugging_face_folder_like_the_consolidated_file(
    model: Llama, consolidated: Path, tokenizer_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hf = pytest.importorskip("model.hf")
    from safetensors.torch import save_file

    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf.hf_config(model.config)))
    save_file({k: v.contiguous() for k, v in hf.to_hf_state_dict(model.state_dict(), model.config).items()},
              folder / "model.safetensors")
    shutil.copy(tokenizer_path, folder / "tokenizer.model")
    status, out, _ = cli(capsys, str(folder), *SAMPLE)
    assert status == 0 and out == cli(capsys, str(consolidated), *SAMPLE)[1]
