"""State-dict adapter between :class:`model.llama.Llama` and Hugging Face ``LlamaForCausalLM``.

The two architectures compute the same function; only the names and two fused linears differ.
Per block ``i`` (``h`` = head_dim = d_model / n_head, ``H`` = mlp_hidden):

    framework                            Hugging Face
    tok_emb.weight                       model.embed_tokens.weight
    blocks.i.attn_norm.weight            model.layers.i.input_layernorm.weight
    blocks.i.attn.qkv.weight             model.layers.i.self_attn.q_proj.weight   rows [0, n_head·h)
                                         model.layers.i.self_attn.k_proj.weight   next n_kv_head·h rows
                                         model.layers.i.self_attn.v_proj.weight   last n_kv_head·h rows
    blocks.i.attn.proj.weight            model.layers.i.self_attn.o_proj.weight
    blocks.i.mlp_norm.weight             model.layers.i.post_attention_layernorm.weight
    blocks.i.mlp.up_gate.weight          model.layers.i.mlp.up_proj.weight        rows [0, H)
                                         model.layers.i.mlp.gate_proj.weight      rows [H, 2H)
    blocks.i.mlp.down.weight             model.layers.i.mlp.down_proj.weight
    norm.weight                          model.norm.weight
    lm_head.weight                       lm_head.weight

No row permutation of q or k is needed: the framework's RoPE pairs coordinate j with j + h/2 of
each head, which is what HF's ``rotate_half`` does. Both use RMSNorm with a learnable scale,
SwiGLU ``down(silu(gate) · up)``, no biases and an untied lm_head.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from model.llama import Llama, LlamaConfig

HF_WEIGHTS = "model.safetensors"
HF_CONFIG = "config.json"
SP_MODEL = "tokenizer.model"

_TOP = {"tok_emb.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight"}
_BLOCK = {"attn_norm.weight": "input_layernorm.weight", "attn.proj.weight": "self_attn.o_proj.weight",
          "mlp_norm.weight": "post_attention_layernorm.weight", "mlp.down.weight": "mlp.down_proj.weight"}
_QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
_UP_GATE = ("mlp.up_proj.weight", "mlp.gate_proj.weight")


def hf_config(cfg: LlamaConfig, *, dtype: torch.dtype = torch.float32, bos_token_id: int = 1,
              eos_token_id: int = 2) -> dict[str, Any]:
    """The ``config.json`` of the ``LlamaForCausalLM`` that computes what a :class:`Llama` of ``cfg`` does.

    θ is written both as transformers 5's ``rope_parameters`` and as the older top-level ``rope_theta``;
    ``dtype`` names the stored weights' dtype (``float32`` or ``bfloat16``).
    """
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp_hidden,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "dtype": str(dtype).removeprefix("torch."),
    }


def llama_config_from_hf(config: Mapping[str, Any]) -> LlamaConfig:
    """The :class:`LlamaConfig` of an HF Llama ``config.json`` (the inverse of :func:`hf_config`).

    ValueError for a config this architecture cannot express: another model type, biases, tied
    embeddings, an activation other than SiLU, RoPE scaling, or head_dim ≠ hidden_size / num_attention_heads.
    """
    rope = config.get("rope_parameters") or {"rope_type": "default", "rope_theta": config.get("rope_theta", 10000.0)}
    unsupported = {
        "model_type": (config.get("model_type"), "llama"),
        "hidden_act": (config.get("hidden_act", "silu"), "silu"),
        "tie_word_embeddings": (config.get("tie_word_embeddings", False), False),
        "attention_bias": (config.get("attention_bias", False), False),
        "mlp_bias": (config.get("mlp_bias", False), False),
        "rope_type": (rope.get("rope_type", "default"), "default"),
        "head_dim": (config.get("head_dim", config["hidden_size"] // config["num_attention_heads"]),
                     config["hidden_size"] // config["num_attention_heads"]),
    }
    for key, (got, want) in unsupported.items():
        if got != want:
            raise ValueError(f"HF config has {key}={got!r}; model.llama.Llama supports only {key}={want!r}")
    return LlamaConfig(
        vocab_size=config["vocab_size"],
        n_layer=config["num_hidden_layers"],
        d_model=config["hidden_size"],
        n_head=config["num_attention_heads"],
        n_kv_head=config.get("num_key_value_heads") or config["num_attention_heads"],
        mlp_hidden=config["intermediate_size"],
        max_seq_len=config["max_position_embeddings"],
        rope_theta=float(rope["rope_theta"]),
        norm_eps=float(config["rms_norm_eps"]),
    )


def _expected_shapes(cfg: LlamaConfig) -> dict[str, torch.Size]:
    """Parameter name → shape of a :class:`Llama` of ``cfg`` (built on the meta device, no memory)."""
    with torch.device("meta"):
        return {name: p.shape for name, p in Llama(cfg).named_parameters()}


def _checked(state_dict: Mapping[str, torch.Tensor], shapes: Mapping[str, torch.Size], kind: str,
             ignore_extra: bool) -> None:
    """ValueError unless ``state_dict`` holds every name of ``shapes`` with that shape; other names are
    an error too, unless ``ignore_extra``."""
    if missing := sorted(set(shapes) - set(state_dict)):
        raise ValueError(f"{kind} state dict lacks {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    if not ignore_extra and (extra := sorted(set(state_dict) - set(shapes))):
        raise ValueError(f"{kind} state dict has unexpected keys {extra[:4]}{' ...' if len(extra) > 4 else ''}")
    for name, shape in shapes.items():
        if state_dict[name].shape != shape:
            raise ValueError(f"{kind} {name} has shape {tuple(state_dict[name].shape)}, the config "
                             f"needs {tuple(shape)}")


def _hf_shapes(cfg: LlamaConfig) -> dict[str, torch.Size]:
    """HF parameter name → shape for ``cfg``, derived from the framework's through the mapping."""
    return {k: v.shape for k, v in to_hf_state_dict(
        {k: torch.empty(s, device="meta") for k, s in _expected_shapes(cfg).items()}, cfg).items()}


def to_hf_state_dict(state_dict: Mapping[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """The ``LlamaForCausalLM`` state dict of a framework state dict (mapping in the module docstring).

    ``attn.qkv`` (rows [q | k | v]) is split into q_proj (n_head·h rows), k_proj and v_proj
    (n_kv_head·h rows each); ``mlp.up_gate`` (rows [up | gate]) into up_proj and gate_proj. Quantized
    linears keep ``nn.Linear``'s ``weight`` key; their extra buffers (e.g. ``delayed_amax``), which are
    quantizer state and no part of the function, are left out. Returned tensors are views of the inputs.
    """
    shapes = _expected_shapes(cfg)
    if unexpected := sorted(k for k in set(state_dict) - set(shapes) if k.rsplit(".", 1)[-1] == "weight"):
        raise ValueError(f"framework state dict has weights that no Llama of this config has: {unexpected[:4]}")
    _checked(state_dict, shapes, "framework", ignore_extra=True)
    q, kv = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
    out = {hf: state_dict[ours] for ours, hf in _TOP.items()}
    for i in range(cfg.n_layer):
        ours, hf = f"blocks.{i}.", f"model.layers.{i}."
        out |= {hf + h: state_dict[ours + o] for o, h in _BLOCK.items()}
        out |= dict(zip((hf + h for h in _QKV), state_dict[ours + "attn.qkv.weight"].split([q, kv, kv])))
        out |= dict(zip((hf + h for h in _UP_GATE), state_dict[ours + "mlp.up_gate.weight"].chunk(2)))
    return out


def hf_linears(cfg: LlamaConfig) -> dict[str, list[tuple[str, int]]]:
    """Framework linear module → the ``LlamaForCausalLM`` linear modules it becomes, each with its
    number of rows, in row order (the mapping of the module docstring, without ``.weight``):
    ``blocks.i.attn.qkv`` → q_proj, k_proj, v_proj; ``blocks.i.mlp.up_gate`` → up_proj, gate_proj;
    the other block linears and ``lm_head`` one to one. ``weight.split([rows, ...])`` gives the
    HF weights of a framework weight, as :func:`to_hf_state_dict` does."""
    q, kv, h = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim, cfg.mlp_hidden
    out = {"lm_head": [("lm_head", cfg.vocab_size)]}
    for i in range(cfg.n_layer):
        ours, hf = f"blocks.{i}.", f"model.layers.{i}."
        out[ours + "attn.qkv"] = [(hf + n.removesuffix(".weight"), r) for n, r in zip(_QKV, (q, kv, kv))]
        out[ours + "attn.proj"] = [(hf + "self_attn.o_proj", cfg.d_model)]
        out[ours + "mlp.up_gate"] = [(hf + n.removesuffix(".weight"), h) for n in _UP_GATE]
        out[ours + "mlp.down"] = [(hf + "mlp.down_proj", cfg.d_model)]
    return out


def from_hf_state_dict(hf_sd: Mapping[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """The framework state dict of a ``LlamaForCausalLM`` state dict: the inverse of :func:`to_hf_state_dict`
    (``attn.qkv`` = cat[q_proj, k_proj, v_proj], ``mlp.up_gate`` = cat[up_proj, gate_proj] along rows).

    ValueError when a key is missing, unexpected, or has the wrong shape for ``cfg``.
    """
    _checked(hf_sd, _hf_shapes(cfg), "HF", ignore_extra=False)
    out = {ours: hf_sd[hf] for ours, hf in _TOP.items()}
    for i in range(cfg.n_layer):
        ours, hf = f"blocks.{i}.", f"model.layers.{i}."
        out |= {ours + o: hf_sd[hf + h] for o, h in _BLOCK.items()}
        out[ours + "attn.qkv.weight"] = torch.cat([hf_sd[hf + h] for h in _QKV])
        out[ours + "mlp.up_gate.weight"] = torch.cat([hf_sd[hf + h] for h in _UP_GATE])
    return out


def decompressed(weights: Mapping[str, torch.Tensor],
                 quantization_config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """``weights`` of a compressed-tensors ``nvfp4-pack-quantized`` folder with every quantized module's
    ``weight_packed``, ``weight_scale`` and ``weight_global_scale`` replaced by its dense ``weight``,
    as compressed-tensors' own ``NVFP4PackedCompressor.decompress`` computes it (BF16; its
    activation scales are dropped: the framework model runs the weights only, W4A16).
    ValueError for another format, or when compressed-tensors is not installed."""
    if quantization_config.get("format") != "nvfp4-pack-quantized":
        raise ValueError(f"the folder's quantization_config has format {quantization_config.get('format')!r}; "
                         f"model.hf reads nvfp4-pack-quantized only (scripts/export_hf.py --format nvfp4)")
    try:
        from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
        from compressed_tensors.quantization import QuantizationConfig
    except ImportError as err:
        raise ValueError(f"an NVFP4 folder needs compressed-tensors ({err}). Fix: pip install -e '.[eval]'.") from None
    scheme = QuantizationConfig.model_validate(dict(quantization_config)).config_groups["group_0"]
    out = {k: v for k, v in weights.items() if not k.rpartition(".")[2].startswith(("weight_", "input_"))}
    for key in weights:
        if key.endswith(".weight_packed"):
            module = key.removesuffix(".weight_packed")
            local = {k.removeprefix(module + "."): v for k, v in weights.items() if k.startswith(module + ".")}
            out[module + ".weight"] = NVFP4PackedCompressor.decompress(local, scheme)["weight"]
    return out


def load_hf_folder(path: str | Path) -> tuple[Llama, Path | None]:
    """The framework :class:`Llama` of an exported folder (``config.json`` + ``model.safetensors``), on CPU
    in eval mode with float32 parameters (bf16-stored weights are widened exactly; an NVFP4 folder's
    weights are decompressed by compressed-tensors, :func:`decompressed`), and the folder's
    SentencePiece ``tokenizer.model`` (None when it has none)."""
    path = Path(path)
    cfg = llama_config_from_hf(json.loads((path / HF_CONFIG).read_text()))
    with torch.device("meta"):
        model = Llama(cfg)
    model.to_empty(device="cpu")
    config = json.loads((path / HF_CONFIG).read_text())
    weights = load_file(path / HF_WEIGHTS)
    if config.get("quantization_config"):
        weights = decompressed(weights, config["quantization_config"])
    model.load_state_dict({k: v.float() for k, v in from_hf_state_dict(weights, cfg).items()}, strict=True)
    model.init_buffers()
    tokenizer = path / SP_MODEL
    return model.eval(), tokenizer if tokenizer.is_file() else None
