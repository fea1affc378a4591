"""Export a trained model to a Hugging Face ``LlamaForCausalLM`` folder (docs/export.md).

    python scripts/export_hf.py runs/<run> hf/<run>                       # its newest complete checkpoint
    python scripts/export_hf.py runs/<run>/checkpoints/step_00001000 hf/out --dtype bf16
    python scripts/export_hf.py model.pt hf/out --tokenizer tokenizer.model   # from export_checkpoint.py
    python scripts/export_hf.py runs/<run> hf/<run>-nvfp4 --format nvfp4      # the forward's NVFP4 weights

The source is a run directory, a DCP checkpoint directory (``step_XXXXXXXX``, resolved and verified
as scripts/export_checkpoint.py does) or the consolidated ``.pt`` that script writes. OUT_DIR gets
``config.json``, ``model.safetensors`` (the FP32 master weights, or BF16 with ``--dtype bf16``), the
tokenizer (``tokenizer.model``, ``tokenizer.json``, ``tokenizer_config.json``,
``special_tokens_map.json``), ``generation_config.json`` and a ``README.md`` model card. The tokenizer
is ``--tokenizer``, else the run config's ``data.tokenizer_path``, else the ``tokenizer.model`` of the
prepared dataset directory. Everything is written to a temporary directory first and renamed into
place, so a failed export leaves OUT_DIR as it was.

``--format nvfp4`` writes compressed-tensors' ``nvfp4-pack-quantized`` format instead
(``inference.nvfp4``; vLLM and transformers load it): each linear that trained with NVFP4 forward
weights holds the very Ŵ of the forward pass (packed E2M1 codes, E4M3 scale per 1×16 group, FP32
global scale), and ``input_global_scale`` calibrated on ``--calib-batches`` batches of the run's
validation split (0: a weight-only export); the layers that trained in BF16 stay BF16 and are
listed in ``ignore``. A run whose forward weights were BF16 gets RTN 1×16 post-training
quantization. docs/export.md says what is exact.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import sentencepiece as spm
import torch
from safetensors.torch import save_file

from data.tokenizer import Tokenizer, check_vocab
from inference.nvfp4 import compressed_state_dict, forward_weight_dtype, forward_weights, quantization_config
from inference.served import calibrate_input_amax, trained_model, validation_batches
from inference.trained_model import consolidate, find_tokenizer, read_consolidated
from model.hf import HF_CONFIG, HF_WEIGHTS, SP_MODEL, hf_config, to_hf_state_dict
from model.llama import LlamaConfig, build_model
from scripts.export_checkpoint import resolve_checkpoint
from training.checkpoint import read_extra
from training.run_dir import read_metrics, val_losses

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FORMATS = ("hf", "nvfp4")
_CALIB_FIX = ("Fix: --calib-batches no more than the split holds, prepare the run's dataset here "
              "(scripts/prepare_data.py), or --calib-batches 0 for a weight-only export.")
PROBE = "  Probe: 1234 tokens,\tüñí漢字\n\nend "  # checked to encode alike in SentencePiece and HF


def load_source(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], int, Path | None, int | None]:
    """State dict, resolved run config, step, run directory and world size (None when unknown) of
    ``path``: a consolidated ``.pt`` of scripts/export_checkpoint.py, a checkpoint or a run directory
    (``inference.trained_model``). FileNotFoundError / ValueError (with the fix) for anything else."""
    if path.is_file():
        blob, run_dir, world_size = read_consolidated(path), None, None
    else:
        checkpoint = resolve_checkpoint(path)
        blob = consolidate(checkpoint)
        run_dir = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else None
        world_size = (read_extra(checkpoint).get("fingerprint") or {}).get("world_size")
    return blob["model"], blob["config"], int(blob.get("step", 0)), run_dir, world_size


def _check_out(out: Path, force: bool) -> None:
    """ValueError when ``out`` is a file, or a non-empty directory and not ``force``."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is a file. Fix: choose another OUT_DIR")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ValueError(f"{out} exists and is not empty. Fix: choose another OUT_DIR, or pass --force to replace it")


def write_tokenizer(sp_model: Path, out: Path, max_len: int) -> tuple[int, int]:
    """Write the HF tokenizer files of ``sp_model`` into ``out``; returns its (bos, eos) ids.

    ``tokenizer.json`` is built by transformers' SentencePiece converter, which follows the model's own
    normaliser settings; HF then encodes like ``data.tokenizer.Tokenizer.encode``: no BOS or EOS is
    added and "<s>"-like text is not parsed as a special token (``split_special_tokens``).
    ValueError when a probe text still encodes differently.
    """
    from transformers import AutoTokenizer

    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    specials = {f"{name}_token": sp.id_to_piece(i)
                for name, i in (("unk", sp.unk_id()), ("bos", sp.bos_id()), ("eos", sp.eos_id())) if i >= 0}
    shutil.copyfile(sp_model, out / SP_MODEL)
    _write_json(out / "special_tokens_map.json", specials)
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", **specials, "add_bos_token": False, "add_eos_token": False,
        "split_special_tokens": True, "clean_up_tokenization_spaces": False, "model_max_length": max_len,
    })
    AutoTokenizer.from_pretrained(out).backend_tokenizer.save(str(out / "tokenizer.json"))
    hf_ids = AutoTokenizer.from_pretrained(out)(PROBE)["input_ids"]
    if hf_ids != sp.encode(PROBE):
        raise ValueError(f"the converted HF tokenizer encodes {PROBE!r} as {hf_ids}, SentencePiece as "
                         f"{sp.encode(PROBE)}; {sp_model} uses settings transformers cannot reproduce")
    return sp.bos_id(), sp.eos_id()


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def _run_results(run_dir: Path | None, config: Mapping[str, Any], step: int) -> dict[str, Any]:
    """Preset, scheme, run name, step, tokens (step × batch_size × seq_len) and the validation loss at
    ``step`` (from metrics.jsonl, else summary.json when it is the final step; None when unrecorded)."""
    train = config.get("train") or {}
    summary_path = run_dir / "summary.json" if run_dir else None
    summary = json.loads(summary_path.read_text()) if summary_path and summary_path.is_file() else {}
    val = val_losses(read_metrics(run_dir)).get(step) if run_dir else None
    if val is None and summary.get("steps") == step:
        val = summary.get("final_val_loss")
    tokens = step * train["batch_size"] * train["seq_len"] if {"batch_size", "seq_len"} <= set(train) else None
    return {"preset": (config.get("model") or {}).get("name"), "scheme": (config.get("quant") or {}).get("name"),
            "run": config.get("run_name") or (run_dir.name if run_dir else None), "step": step,
            "tokens": tokens, "val_loss": val}


WEIGHTS_TEXT = {
    "hf": "The weights are the high-precision master weights of the NVFP4-trained model, stored as {dtype}:\n"
          "NVFP4 was used in training only, and this checkpoint runs as an ordinary Llama.",
    "forward": "The linears that trained with NVFP4 forward weights hold those very weights (Ŵ of the training\n"
               "forward pass) in compressed-tensors' `nvfp4-pack-quantized` format; the layers that trained in\n"
               "BF16 are BF16 and listed in `quantization_config.ignore`. Serve with `vllm serve PATH`.",
    "ptq": "The block linears hold RTN 1x16 post-training NVFP4 quantizations of the master weights, in\n"
           "compressed-tensors' `nvfp4-pack-quantized` format (the run trained with BF16 forward weights);\n"
           "the layers in `quantization_config.ignore` are BF16. Serve with `vllm serve PATH`.",
}


def model_card(results: Mapping[str, Any], cfg: LlamaConfig, dtype: str, weights: str = "hf") -> str:
    """README.md of the exported folder; ``weights``: ``hf`` (master weights), ``forward`` (the forward's
    NVFP4 Ŵ) or ``ptq`` (RTN post-training NVFP4)."""
    loss = f"{results['val_loss']:.4f}" if results["val_loss"] is not None else "not recorded"
    tokens = f"{results['tokens']:,}" if results["tokens"] is not None else "unknown"
    return f"""---
library_name: transformers
pipeline_tag: text-generation
tags: [llama, nvfp4]
---

# {results['run'] or results['preset']}

A Llama-style decoder ({cfg.n_layer} layers, d_model {cfg.d_model}, {cfg.n_head} heads, {cfg.n_kv_head} key/value
heads, vocabulary {cfg.vocab_size}) pre-trained under the `{results['scheme']}` quantization scheme.

| preset | scheme | steps | tokens | validation loss at this step |
|---|---|---|---|---|
| {results['preset']} | {results['scheme']} | {results['step']} | {tokens} | {loss} |

{WEIGHTS_TEXT[weights].format(dtype=dtype)} The training scheme is
recorded in `config.json` under `nvfp4_training`.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("PATH")
model = AutoModelForCausalLM.from_pretrained("PATH")
```

The tokenizer adds no BOS: training documents were EOS-terminated and never started with BOS.
"""


def _training_record(config: Mapping[str, Any], results: Mapping[str, Any]) -> dict[str, Any]:
    return {"scheme": results["scheme"], "run": results["run"], "step": results["step"],
            "quant": dict(config.get("quant") or {})}


def write_folder(out: Path, state: Mapping[str, torch.Tensor], config: Mapping[str, Any], results: Mapping[str, Any],
                 cfg: LlamaConfig, sp_model: Path, dtype: torch.dtype) -> None:
    """Write every file of the exported folder into the existing directory ``out``."""
    bos, eos = write_tokenizer(sp_model, out, cfg.max_seq_len)
    weights = {k: v.detach().to(dtype=dtype, copy=True).contiguous() for k, v in to_hf_state_dict(state, cfg).items()}
    save_file(weights, out / HF_WEIGHTS, metadata={"format": "pt"})
    hf = hf_config(cfg, dtype=dtype, bos_token_id=bos, eos_token_id=eos)
    hf["nvfp4_training"] = _training_record(config, results)
    _write_json(out / HF_CONFIG, hf)
    _write_json(out / "generation_config.json", {"bos_token_id": bos, "eos_token_id": eos})
    (out / "README.md").write_text(model_card(results, cfg, hf["dtype"]))


def write_nvfp4_folder(out: Path, state: Mapping[str, torch.Tensor], config: Mapping[str, Any],
                       results: Mapping[str, Any], cfg: LlamaConfig, sp_model: Path, weight_dtype: torch.dtype,
                       calib: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Write the ``nvfp4-pack-quantized`` folder (module docstring) into the existing directory ``out``;
    ``calib``: the calibration batches of ``input_global_scale`` (none: weights only)."""
    weights, _, ptq = forward_weights(state, cfg, config["quant"], weight_dtype)
    amax = calibrate_input_amax(trained_model(state, config), weights, calib) if calib else None
    bos, eos = write_tokenizer(sp_model, out, cfg.max_seq_len)
    tensors, ignore, ties = compressed_state_dict(cfg, weights, amax, to_hf_state_dict(state, cfg))
    save_file(tensors, out / HF_WEIGHTS, metadata={"format": "pt"})
    hf = hf_config(cfg, dtype=torch.bfloat16, bos_token_id=bos, eos_token_id=eos)
    hf["quantization_config"] = quantization_config(ignore, activations=amax is not None)
    hf["nvfp4_training"] = _training_record(config, results) | {"export": {
        "weights": "rtn_ptq" if ptq else "forward", "forward_weights_from": str(weight_dtype).removeprefix("torch."),
        "calibration_batches": len(calib), "bf16_ties_other_neighbour": ties}}
    _write_json(out / HF_CONFIG, hf)
    _write_json(out / "generation_config.json", {"bos_token_id": bos, "eos_token_id": eos})
    (out / "README.md").write_text(model_card(results, cfg, "bfloat16", "ptq" if ptq else "forward"))


def _publish(tmp: Path, out: Path) -> None:
    """Rename the finished ``tmp`` to ``out``, replacing what ``out`` held."""
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out)


def export_hf(source: Path, out: Path, dtype: str = "fp32", tokenizer: Path | None = None,
              force: bool = False, format: str = "hf", calib_batches: int = 8,
              forward_weights_from: str | None = None) -> Path:
    """Export ``source`` (see :func:`load_source`) as an HF folder at ``out``; returns ``out``.

    ``format``: ``hf`` (master weights in ``dtype``) or ``nvfp4`` (module docstring; ``calib_batches``
    validation batches calibrate ``input_global_scale``, ``forward_weights_from`` overrides the dtype
    the forward quantized its weights from, ``inference.nvfp4.forward_weight_dtype``).
    Every check (source, tokenizer, out, calibration data) runs before anything is written."""
    if format not in FORMATS:
        raise ValueError(f"unknown --format {format!r}; choose one of {FORMATS}")
    if calib_batches < 0:
        raise ValueError(f"--calib-batches must be 0 (weight-only) or more, got {calib_batches}")
    _check_out(out, force)
    state, config, step, run_dir, world_size = load_source(source)
    cfg = build_model(config["model"], device="meta").config
    sp_model = find_tokenizer(tokenizer, None, config)
    check_vocab(Tokenizer(sp_model), cfg.vocab_size)
    if format == "nvfp4":
        weight_dtype = (DTYPES[forward_weights_from] if forward_weights_from
                        else forward_weight_dtype(config, world_size))
        calib = validation_batches(config, calib_batches, _CALIB_FIX) if calib_batches else []
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        results = _run_results(run_dir, config, step)
        if format == "nvfp4":
            write_nvfp4_folder(tmp, state, config, results, cfg, sp_model, weight_dtype, calib)
        else:
            write_folder(tmp, state, config, results, cfg, sp_model, DTYPES[dtype])
        _publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    """Command line (see the module docstring); returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", type=Path, help="run directory, step_XXXXXXXX checkpoint, or consolidated .pt")
    p.add_argument("out", type=Path, help="output folder (must not exist or be empty, unless --force)")
    p.add_argument("--format", choices=FORMATS, default="hf",
                   help="hf: master weights (default); nvfp4: the forward's NVFP4 weights, compressed-tensors format")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="stored weight dtype of --format hf")
    p.add_argument("--calib-batches", type=int, default=8,
                   help="--format nvfp4: validation batches that calibrate input_global_scale (0: weights only)")
    p.add_argument("--forward-weights", choices=sorted(DTYPES),
                   help="--format nvfp4: the dtype the training forward quantized its weights from "
                        "(default: from the run's precision and FSDP settings)")
    p.add_argument("--tokenizer", type=Path, help="SentencePiece tokenizer.model (default: from the run config)")
    p.add_argument("--force", action="store_true", help="replace a non-empty OUT_DIR")
    a = p.parse_args(argv)
    try:
        print(export_hf(a.source, a.out, a.dtype, a.tokenizer, a.force, a.format, a.calib_batches,
                        a.forward_weights))
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
