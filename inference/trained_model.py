"""A trained model back from any of its forms on disk, for inference (scripts/generate.py,
scripts/evaluate.py): a run directory (its newest complete checkpoint), a DCP checkpoint directory,
a consolidated ``.pt`` (scripts/export_checkpoint.py) or an exported Hugging Face folder
(scripts/export_hf.py); and the tokenizer it was trained with. The model is plain
``build_model(config["model"])`` weights, without quantization (an NVFP4 folder's weights are
decompressed by compressed-tensors, ``model.hf.decompressed``)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from data.prepare import REPO_ROOT, dataset_dir
from model.llama import Llama, build_model
from training.checkpoint import export, resolve_checkpoint

KINDS = ("a run directory, a checkpoints/step_XXXXXXXX directory, a consolidated .pt from "
         "scripts/export_checkpoint.py, or an exported Hugging Face folder (config.json and "
         "model.safetensors)")


def is_hf_folder(path: Path) -> bool:
    """Whether ``path`` is an exported Hugging Face folder: a directory with config.json and
    model.safetensors."""
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def read_consolidated(path: Path) -> dict[str, Any]:
    """The ``{"model", "config", "step"}`` dict of a consolidated checkpoint file; ValueError when
    ``path`` is not one."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch.load raises many types for files it cannot read; all mean "not one"
        reason = " ".join(str(err).split())  # one line: torch's messages span several
        raise ValueError(f"{path} is not a consolidated checkpoint ({type(err).__name__}: {reason}). "
                         f"Fix: pass {KINDS}.") from None
    if not isinstance(state, dict) or not {"model", "config"} <= state.keys():
        raise ValueError(f"{path} is a torch file but not a consolidated checkpoint (a dict with "
                         f"'model' and 'config', as scripts/export_checkpoint.py writes). Fix: pass {KINDS}.")
    return state


def consolidate(path: Path) -> dict[str, Any]:
    """The consolidated dict of a run or DCP checkpoint directory (:func:`training.checkpoint.export`)."""
    try:
        checkpoint = resolve_checkpoint(path)
    except ValueError as err:
        raise ValueError(f"{err} Nor is it an exported Hugging Face folder (config.json with "
                         f"model.safetensors).") from None
    print(f"loading {checkpoint}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        return read_consolidated(export(checkpoint, Path(tmp) / "model.pt"))


def model_from_state(state: dict[str, Any], device: torch.device) -> Llama:
    """``build_model(config["model"])`` on ``device`` with the consolidated weights, in eval mode.

    Quantizer buffers of the state dict (such as ``delayed_amax``) are left out; ValueError when a
    weight is missing, extra or of another shape."""
    model = build_model(state["config"]["model"], device=device)
    try:
        loaded = model.load_state_dict(state["model"], strict=False)
    except RuntimeError as err:
        raise ValueError(f"the checkpoint's weights do not fit its model config: {err}") from None
    extra = [k for k in loaded.unexpected_keys if k.endswith(".weight")]
    if loaded.missing_keys or extra:
        raise ValueError(f"the checkpoint's weights do not fit its model config: missing "
                         f"{loaded.missing_keys[:4]}, unexpected {extra[:4]}")
    return model.eval()


def load_checkpoint(path: Path, device: torch.device) -> tuple[Llama, dict[str, Any] | None, Path | None]:
    """The model at ``path`` (any kind of the module docstring) on ``device`` in eval mode, the run
    config (None for a Hugging Face folder) and the folder's tokenizer (None for the other kinds)."""
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist. Fix: pass {KINDS}.")
    if path.is_dir() and is_hf_folder(path):
        try:
            from model.hf import load_hf_folder
        except ImportError as err:
            raise ValueError(f"{path} is a Hugging Face folder, which cannot be read here ({err}). "
                             f"Fix: pip install -e '.[eval]'.") from None
        model, tokenizer = load_hf_folder(path)
        return model.to(device).eval(), None, tokenizer
    state = consolidate(path) if path.is_dir() else read_consolidated(path)
    return model_from_state(state, device), state["config"], None


def find_tokenizer(given: Path | None, hf_tokenizer: Path | None, config: dict[str, Any] | None) -> Path:
    """The tokenizer file, by the order of the module docstring; FileNotFoundError naming the
    --tokenizer fix when there is none."""
    fix = "Fix: pass --tokenizer /path/to/tokenizer.model (the SentencePiece model the run trained with)."
    if given is not None:
        if not given.is_file():
            raise FileNotFoundError(f"--tokenizer {given} does not exist. {fix}")
        return given
    if hf_tokenizer is not None:
        return hf_tokenizer
    data = (config or {}).get("data")
    if not data:
        raise FileNotFoundError(f"no tokenizer: the checkpoint holds none and names no dataset. {fix}")
    if data.get("tokenizer_path"):
        path = REPO_ROOT / Path(data["tokenizer_path"]).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer: the run's data.tokenizer_path {path} does not exist. {fix}")
        return path
    from omegaconf import OmegaConf

    try:
        path = dataset_dir(OmegaConf.create(data)) / "tokenizer.model"
    except (ValueError, FileNotFoundError) as err:
        raise FileNotFoundError(f"no tokenizer: the run's prepared dataset cannot be located ({err}). {fix}") from None
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer: the run's prepared dataset has no {path}. {fix}")
    return path


def pick_device(name: str) -> torch.device:
    """``cpu``, ``cuda``, or ``auto`` (cuda when available); ValueError for cuda without a GPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but no CUDA GPU is available. Fix: --device cpu (or auto).")
    return torch.device(name)
