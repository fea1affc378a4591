"""The Llama-style decoder of the paper's C4 study (SPEC §4).

Architecture, in the order a token sees it:

    x = tok_emb(idx)                                      token embedding, no positional embedding
    for each of the n_layer blocks:
        x = x + proj(Attention(RoPE(q), RoPE(k), v))      q, k, v = split(qkv(RMSNorm(x)))
        x = x + down(silu(gate) * up)                     up, gate = split(up_gate(RMSNorm(x)))
    logits = lm_head(RMSNorm(x))                          untied from tok_emb

- RMSNorm before every sub-layer and before the head (pre-norm), eps 1e-5, learnable scale, no bias.
- Rotary position embedding (RoPE) on queries and keys, base θ = 10000, "half-split" pairing: coordinate i
  of a head is rotated together with coordinate i + head_dim/2.
- Causal attention through ``F.scaled_dot_product_attention(is_causal=True)``; optional grouped-query
  attention (``n_kv_head`` key/value heads shared by groups of ``n_head / n_kv_head`` query heads).
- SwiGLU MLP with hidden width 256·⌈(8·d_model/3)/256⌉ unless set explicitly.
- No biases anywhere. Init: N(0, 0.02) for the embedding and every linear, N(0, 0.02/√(2·n_layer)) for the
  two residual output projections of each block (``attn.proj`` and ``mlp.down``), norm scales 1.

The four block linears (``attn.qkv``, ``attn.proj``, ``mlp.up_gate``, ``mlp.down``) are plain
``nn.Linear(bias=False)`` modules that are only ever called as ``module(x)``, so the quantization code can
swap them for subclasses of ``nn.Linear`` after the model is built.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

INIT_STD = 0.02  # SPEC §4


def swiglu_hidden(d_model: int) -> int:
    """SwiGLU hidden width of SPEC §4: 8·d/3 rounded up to a multiple of 256."""
    return 256 * -(-8 * d_model // (3 * 256))


@dataclass
class LlamaConfig:
    """Shape of the model (SPEC §4). ``n_kv_head=None`` means full multi-head attention and
    ``mlp_hidden=None`` means the SwiGLU formula :func:`swiglu_hidden`."""

    vocab_size: int
    n_layer: int
    d_model: int
    n_head: int
    max_seq_len: int
    n_kv_head: int | None = None
    mlp_hidden: int | None = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.mlp_hidden is None:
            self.mlp_hidden = swiglu_hidden(self.d_model)
        for name in ("vocab_size", "n_layer", "d_model", "n_head", "n_kv_head", "mlp_hidden", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head}): "
                f"pick n_head so that d_model / n_head is the head dimension (128 in the SPEC presets)"
            )
        if self.n_head % self.n_kv_head:
            raise ValueError(
                f"n_head ({self.n_head}) must be divisible by n_kv_head ({self.n_kv_head}): "
                f"each key/value head serves a whole group of query heads; use a divisor of n_head "
                f"(or null for full multi-head attention)"
            )
        if self.head_dim % 2:
            raise ValueError(f"head dimension d_model / n_head = {self.head_dim} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learnable per-channel scale and no bias (SPEC §4)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)


def rope_tables(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each (seq_len, head_dim / 2), float32.

    Pair i of a head turns by angle t · θ^(-2i / head_dim) at position t (SPEC §4: θ = 10000).
    """
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64, device=device), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x of shape (B, T, heads, head_dim) by the angles of positions 0..T-1.

    Half-split pairing: coordinates (i, i + head_dim/2) form one 2-D plane. Computed in float32 and cast
    back to x's dtype.
    """
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


class Attention(nn.Module):
    """Causal self-attention with RoPE and optional grouped-query attention (SPEC §4).

    ``qkv`` is one fused projection whose output is laid out as [n_head query heads | n_kv_head key heads |
    n_kv_head value heads], each head_dim wide; query head h reads key/value head h // (n_head / n_kv_head).
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.qkv = nn.Linear(config.d_model, (config.n_head + 2 * config.n_kv_head) * config.head_dim, bias=False)
        self.proj = nn.Linear(config.n_head * config.head_dim, config.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split(
            [self.n_head * self.head_dim, self.n_kv_head * self.head_dim, self.n_kv_head * self.head_dim], dim=-1
        )
        q = apply_rope(q.view(B, T, self.n_head, self.head_dim), cos, sin)
        k = apply_rope(k.view(B, T, self.n_kv_head, self.head_dim), cos, sin)
        v = v.view(B, T, self.n_kv_head, self.head_dim)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            is_causal=True, enable_gqa=self.n_kv_head != self.n_head,
        )
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward (SPEC §4): ``down(silu(gate) * up)``, with ``up_gate`` one fused linear whose
    output is [up | gate], each mlp_hidden wide."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.up_gate = nn.Linear(config.d_model, 2 * config.mlp_hidden, bias=False)
        self.down = nn.Linear(config.mlp_hidden, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, gate = self.up_gate(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)) (SPEC §4)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """The decoder of SPEC §4: embedding, n_layer blocks, final RMSNorm, untied lm_head.

    Built on the current default device. Under ``torch.device("meta")`` nothing is initialised; call
    ``to_empty(device=...)`` and then :meth:`init_weights` to materialise the model.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        # RoPE tables are derived state, recomputed by init_weights and never checkpointed.
        half = config.head_dim // 2
        self.register_buffer("rope_cos", torch.empty(config.max_seq_len, half), persistent=False)
        self.register_buffer("rope_sin", torch.empty(config.max_seq_len, half), persistent=False)
        if not self.lm_head.weight.is_meta:
            self.init_weights()

    def init_plan(self) -> dict[str, float | None]:
        """SPEC §4 init of every parameter by name: the std of a zero-mean normal, or None for ones.

        N(0, 0.02) for the embedding and all linears, N(0, 0.02/√(2·n_layer)) for ``attn.proj`` and
        ``mlp.down`` (the residual output projections), ones for norm scales.
        """
        residual_std = INIT_STD / math.sqrt(2 * self.config.n_layer)
        plan: dict[str, float | None] = {}
        for name, _ in self.named_parameters():
            if name.endswith("norm.weight"):
                plan[name] = None
            elif name.endswith(("attn.proj.weight", "mlp.down.weight")):
                plan[name] = residual_std
            else:
                plan[name] = INIT_STD
        return plan

    @torch.no_grad()
    def init_weights(self) -> None:
        """SPEC §4 init in place (see :meth:`init_plan`) from the global RNG, in parameter order;
        then recompute the RoPE tables."""
        plan = self.init_plan()
        for name, p in self.named_parameters():
            if plan[name] is None:
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, std=plan[name])
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """(Re)compute the non-persistent RoPE tables on the model's device."""
        cos, sin = rope_tables(self.config.max_seq_len, self.config.head_dim, self.config.rope_theta,
                               self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """idx: (B, T) token ids. Returns logits (B, T, vocab_size), or, given targets (B, T), the mean
        cross-entropy over all positions computed in float32 (targets equal to -100 are ignored)."""
        T = idx.size(1)
        if T > self.config.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len {self.config.max_seq_len}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.tok_emb(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; ``non_embedding`` leaves out ``tok_emb`` and ``lm_head`` (blocks and final norm
        only), the count that SPEC §4 tabulates and that token budgets are based on."""
        total = sum(p.numel() for p in self.parameters())
        if non_embedding:
            total -= self.tok_emb.weight.numel() + self.lm_head.weight.numel()
        return total

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token for MFU: 6·N + 12·n_layer·d_model·seq_len.

        N counts the weights of every matmul (all linears including lm_head; not the embedding lookup nor
        the norms): 2 FLOPs per weight forward, 4 backward. The second term is the attention score and
        value matmuls, QKᵀ and AV, at 2·2·d_model·seq_len per layer forward, ×3 with backward. This is the
        estimate of the PaLM paper, appendix B (Chowdhery et al., 2022); it ignores the causal mask's
        savings.
        """
        n_matmul = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        return 6 * n_matmul + 12 * self.config.n_layer * self.config.d_model * seq_len


def build_model(cfg: Mapping[str, Any], device: torch.device | str | None = None) -> Llama:
    """Build a :class:`Llama` from a model preset (a ``configs/model/*.yaml`` mapping, dict or DictConfig).

    ``name`` and ``peak_lr`` (read by the trainer) are ignored; any other key must be a :class:`LlamaConfig`
    field. ``device`` (the argument, else a ``device`` key) is where the model is built; "meta" gives an
    uninitialised model for FSDP to materialise.
    """
    cfg = dict(cfg)
    cfg_device = cfg.pop("device", None)
    device = torch.device(device if device is not None else cfg_device or torch.get_default_device())
    cfg.pop("name", None)
    cfg.pop("peak_lr", None)
    known = {f.name for f in fields(LlamaConfig)}
    if unknown := sorted(set(cfg) - known):
        raise ValueError(f"unknown model config keys {unknown}; expected a subset of {sorted(known)}")
    config = LlamaConfig(**cfg)
    with device:
        return Llama(config)
