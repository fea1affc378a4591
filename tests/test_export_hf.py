"""Tests of the Hugging Face export (model/hf.py, scripts/export_hf.py): a randomly initialised model,
norm scales included, exported from a consolidated .pt (as scripts/export_checkpoint.py writes it) or a
DCP run directory, computes the same logits in transformers' LlamaForCausalLM and after load_hf_folder;
the HF tokenizer encodes like the SentencePiece one; failures write nothing."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from data.prepare import dataset_dir, iter_documents
from data.tokenizer import Tokenizer, train_tokenizer
from model.hf import from_hf_state_dict, hf_config, llama_config_from_hf, load_hf_folder, to_hf_state_dict
from model.llama import Llama, build_model
from quant.linear import quantize_model
from quant.schemes import get_scheme
from scripts.export_hf import main
from training.checkpoint import Checkpointer

REPO = Path(__file__).resolve().parents[1]
TINY = OmegaConf.to_container(OmegaConf.load(REPO / "configs" / "model" / "tiny.yaml"))
GQA = {"name": "gqa", "vocab_size": 520, "n_layer": 2, "d_model": 96, "n_head": 3, "n_kv_head": 1,
       "mlp_hidden": 160, "max_seq_len": 64, "rope_theta": 500000.0, "norm_eps": 1e-6}
PRESETS = {"tiny": TINY, "gqa": GQA}
# Checkpointer saves in one process here, which DCP warns about; that is the intended mode.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
TEXTS = ["In the beginning God created the heaven and the earth.", "  two  spaces\nand 12345 ünïcødé 漢字\t",
         " leading space", "literal <s> and </s> text", ""]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 512-piece byte-fallback BPE trained on 12 chapters of the bundled corpus."""
    docs = []
    for doc in iter_documents(REPO / "data" / "corpus" / "kjv.txt.xz"):
        docs.append(doc)
        if len(docs) == 12:
            break
    return train_tokenizer(docs, tmp_path_factory.mktemp("tok") / "tokenizer.model", 512).path


def random_model(preset: dict) -> Llama:
    """A Llama of ``preset`` with random weights and norm scales N(1, 0.2)."""
    torch.manual_seed(0)
    model = build_model(preset)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.2)
    return model.eval()


def run_config(preset: dict, sp_model: Path | None) -> dict:
    return {"model": preset, "quant": {"name": "quartet2", "skip": ["lm_head"]}, "run_name": "test-run",
            "data": {"name": "files", "tokenizer_path": str(sp_model) if sp_model else None, "inputs": "???"},
            "train": {"batch_size": 4, "seq_len": 32}}


def write_pt(model: Llama, config: dict, path: Path, step: int = 7) -> Path:
    torch.save({"model": model.state_dict(), "config": config, "step": step}, path)
    return path


@pytest.fixture(scope="module", params=sorted(PRESETS))
def exported(request: pytest.FixtureRequest, sp_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """(model, OUT_DIR) of a random model of each preset exported by the script in FP32."""
    model = random_model(PRESETS[request.param])
    work = tmp_path_factory.mktemp(request.param)
    assert main([str(write_pt(model, run_config(PRESETS[request.param], sp_model), work / "m.pt")),
                 str(work / "hf")]) == 0
    return model, work / "hf"


def tokens(model: Llama, batch: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, model.config.vocab_size, (batch, model.config.max_seq_len), generator=g)


def test_transformers_logits_match_the_framework(exported) -> None:
    model, out = exported
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert hf.config.rope_parameters["rope_theta"] == model.config.rope_theta
    assert hf.config.num_key_value_heads == model.config.n_kv_head
    assert hf.config.rms_norm_eps == model.config.norm_eps
    idx = tokens(model)
    with torch.no_grad():
        ours, theirs = model(idx), hf(idx).logits
    assert theirs.dtype == torch.float32
    assert (ours - theirs).abs().max().item() <= 1e-5


def test_load_hf_folder_gives_identical_logits(exported, sp_model: Path) -> None:
    model, out = exported
    loaded, tokenizer = load_hf_folder(out)
    assert not loaded.training and tokenizer == out / "tokenizer.model"
    assert tokenizer.read_bytes() == sp_model.read_bytes()
    idx = tokens(model)
    with torch.no_grad():
        assert torch.equal(loaded(idx), model(idx))


def test_round_trip_is_the_identity(exported) -> None:
    model, _ = exported
    sd = model.state_dict()
    back = from_hf_state_dict(to_hf_state_dict(sd, model.config), model.config)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    assert llama_config_from_hf(hf_config(model.config)) == model.config


def test_a_quantized_model_state_dict_exports_the_same_weights() -> None:
    model = random_model(TINY)
    plain = to_hf_state_dict(model.state_dict(), model.config)
    quantize_model(model, dataclasses.replace(get_scheme("quartet2"), delayed_amax=True))
    sd = model.state_dict()
    assert any(k.endswith("delayed_amax") for k in sd)  # quantizer state, left out of the export
    quantized = to_hf_state_dict(sd, model.config)
    assert quantized.keys() == plain.keys() and all(torch.equal(quantized[k], plain[k]) for k in plain)
    with pytest.raises(ValueError, match="lacks"):
        to_hf_state_dict({k: v for k, v in sd.items() if k != "norm.weight"}, model.config)
    with pytest.raises(ValueError, match="shape"):
        to_hf_state_dict(sd | {"lm_head.weight": torch.zeros(3, 3)}, model.config)


def test_config_and_model_card_record_the_run(exported) -> None:
    model, out = exported
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
    assert config["nvfp4_training"]["scheme"] == "quartet2" and config["nvfp4_training"]["run"] == "test-run"
    assert config["head_dim"] == model.config.head_dim and config["intermediate_size"] == model.config.mlp_hidden
    card = (out / "README.md").read_text()
    assert "quartet2" in card and "| 7 | 896 |" in card and "master weights" in card  # 7 steps × 4 × 32
    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_hf_tokenizer_encodes_like_sentencepiece(exported, sp_model: Path) -> None:
    _, out = exported
    ours, hf = Tokenizer(sp_model), AutoTokenizer.from_pretrained(out)
    assert (hf.unk_token_id, hf.bos_token_id, hf.eos_token_id) == (0, 1, 2)
    for text in TEXTS:
        assert hf(text)["input_ids"] == ours.encode(text)  # no BOS added, specials in text not parsed
        assert hf.decode(ours.encode(text)) == text


def test_a_run_directory_and_bf16(sp_model: Path, tmp_path: Path) -> None:
    model = random_model(GQA)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = tmp_path / "run"
    Checkpointer(run / "checkpoints").save(5, model, optimizer, {"step": 5, "config": run_config(GQA, sp_model)})
    (run / "summary.json").write_text(json.dumps({"final_val_loss": 4.5, "steps": 5}))
    assert main([str(run), str(tmp_path / "hf"), "--dtype", "bf16"]) == 0
    expected = to_hf_state_dict(model.state_dict(), model.config)
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        assert set(f.keys()) == set(expected)
        for name in f.keys():
            assert f.get_tensor(name).dtype == torch.bfloat16
            assert torch.equal(f.get_tensor(name), expected[name].bfloat16())
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    assert "4.5000" in (tmp_path / "hf" / "README.md").read_text()


def test_the_tokenizer_of_the_prepared_dataset_is_found(sp_model: Path, tmp_path: Path) -> None:
    config = run_config(GQA, None)
    (tmp_path / "corpus.txt").write_text("some text\n")
    config["data"] |= {"inputs": [str(tmp_path / "corpus.txt")], "hf_dataset": None, "vocab_size": 512,
                       "val_fraction": 0.01, "max_tokens": None, "cache_dir": str(tmp_path / "cache")}
    prepared = dataset_dir(config["data"])
    prepared.mkdir(parents=True)
    (prepared / "tokenizer.model").write_bytes(sp_model.read_bytes())
    assert main([str(write_pt(random_model(GQA), config, tmp_path / "m.pt")), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "tokenizer.model").read_bytes() == sp_model.read_bytes()


def error_of(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    return err


def test_errors_write_nothing(sp_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert "neither a checkpoint" in error_of([str(tmp_path), str(out)], capsys)
    assert "not a consolidated checkpoint" in error_of([str(tmp_path / "notes.txt"), str(out)], capsys)
    no_tok = write_pt(random_model(GQA), run_config(GQA, None), tmp_path / "m.pt")
    assert "--tokenizer" in error_of([str(no_tok), str(out)], capsys)
    assert not out.exists()
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert "not empty" in error_of([str(no_tok), str(out), "--tokenizer", str(sp_model)], capsys)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    assert main([str(no_tok), str(out), "--tokenizer", str(sp_model), "--force"]) == 0
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
