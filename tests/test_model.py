"""Tests of the SPEC §4 model: presets, shapes, causality, GQA, init, meta materialisation, config errors."""

import math
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from model import Llama, LlamaConfig, build_model, swiglu_hidden
from model.llama import Attention, apply_rope, rope_tables

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"

# Non-embedding parameter counts of SPEC §4 (1.9b: 32·(4·2048² + 3·2048·5632 + 2·2048) + 2048).
SPEC_NON_EMBEDDING = {
    "30m": 30_482_560,
    "50m": 49_556_736,
    "100m": 102_777_856,
    "200m": 203_188_480,
    "1.9b": 1_644_300_288,
}
PRESETS = ["tiny", *SPEC_NON_EMBEDDING]


def load_preset(name: str) -> dict:
    return OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "model" / f"{name}.yaml"))


def tiny_config(**overrides) -> LlamaConfig:
    cfg = load_preset("tiny")
    del cfg["name"], cfg["peak_lr"]
    return LlamaConfig(**{**cfg, **overrides})


@pytest.mark.parametrize("name", SPEC_NON_EMBEDDING)
def test_paper_preset_builds_on_meta_with_spec_count(name):
    cfg = OmegaConf.load(CONFIG_DIR / "model" / f"{name}.yaml")
    llama = build_model(cfg, device="meta")
    assert all(p.is_meta for p in llama.parameters())
    assert llama.num_params() == SPEC_NON_EMBEDDING[name]
    assert llama.num_params(non_embedding=False) == SPEC_NON_EMBEDDING[name] + 2 * 32000 * cfg.d_model
    assert cfg.name == name and cfg.vocab_size == 32000
    assert llama.config.head_dim == 128
    assert cfg.mlp_hidden == swiglu_hidden(cfg.d_model)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_composes_as_hydra_group(name):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name=None, overrides=[f"+model={name}"])
    assert cfg.model.name == name
    assert isinstance(cfg.model.peak_lr, float) and cfg.model.peak_lr > 0
    assert isinstance(cfg.model.norm_eps, float) and cfg.model.norm_eps == 1e-5
    assert build_model(cfg.model, device="meta").config.d_model == cfg.model.d_model


@pytest.mark.parametrize("name", PRESETS)
def test_block_linear_dims_divide_by_largest_hadamard(name):
    llama = build_model(load_preset(name), device="meta")
    linears = [m for m in llama.blocks.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 4 * llama.config.n_layer
    for m in linears:
        assert m.in_features % 128 == 0 and m.out_features % 128 == 0, m


def test_tiny_preset_shape():
    llama = build_model(load_preset("tiny"), device="meta")
    assert llama.config.mlp_hidden == 512 and llama.config.head_dim == 64
    assert llama.blocks[0].mlp.up_gate.out_features == 1024


def test_forward_shapes_and_initial_loss():
    torch.manual_seed(0)
    cfg = tiny_config()
    llama = Llama(cfg)
    B, T, V = 8, 128, cfg.vocab_size
    idx, targets = torch.randint(V, (B, T)), torch.randint(V, (B, T))
    logits = llama(idx)
    assert logits.shape == (B, T, V)
    loss = llama(idx, targets)
    assert loss.shape == () and loss.dtype == torch.float32 and torch.isfinite(loss)
    # The final RMSNorm gives |h|² = d_model, so each logit w_v·h ~ N(0, s²) with s = 0.02·√d_model.
    # For iid logits E[logsumexp] ≈ ln V + s²/2 and E[z_target] = 0; the mean over N tokens of z_target
    # has standard error s/√N, so allow 6 of those.
    s = 0.02 * math.sqrt(cfg.d_model)
    expected = math.log(V) + s * s / 2
    assert abs(loss.item() - expected) < 6 * s / math.sqrt(B * T)


def test_backward_reaches_every_parameter():
    torch.manual_seed(0)
    llama = Llama(tiny_config())
    idx = torch.randint(llama.config.vocab_size, (2, 16))
    llama(idx, idx).backward()
    for name, p in llama.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_block_linears_are_swappable_for_linear_subclasses():
    # The quantizer replaces block linears by nn.Linear subclasses and relies on a plain module(x) call.
    shapes = []

    class Recording(nn.Linear):
        def forward(self, x):
            shapes.append(tuple(x.shape))
            return super().forward(x)

    torch.manual_seed(0)
    llama = Llama(tiny_config())
    idx = torch.randint(llama.config.vocab_size, (2, 16))
    with torch.no_grad():
        before = llama(idx)
    for block in llama.blocks:
        for parent, attr in [(block.attn, "qkv"), (block.attn, "proj"), (block.mlp, "up_gate"), (block.mlp, "down")]:
            old = getattr(parent, attr)
            new = Recording(old.in_features, old.out_features, bias=False)
            new.weight = old.weight
            setattr(parent, attr, new)
    with torch.no_grad():
        torch.testing.assert_close(llama(idx), before, rtol=0, atol=0)
    assert len(shapes) == 4 * llama.config.n_layer
    assert all(len(shape) == 3 and shape[:2] == (2, 16) for shape in shapes)
    llama.init_weights()  # still works on the swapped modules


def test_bf16_autocast_forward():
    torch.manual_seed(0)
    llama = Llama(tiny_config())
    idx = torch.randint(llama.config.vocab_size, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss = llama(idx), llama(idx, idx)
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32 and torch.isfinite(loss)


def test_causality():
    torch.manual_seed(0)
    llama = Llama(tiny_config())
    idx = torch.randint(llama.config.vocab_size, (2, 32))
    changed = idx.clone()
    changed[:, 20] = (idx[:, 20] + 1) % llama.config.vocab_size
    with torch.no_grad():
        a, b = llama(idx), llama(changed)
    torch.testing.assert_close(a[:, :20], b[:, :20], rtol=0, atol=1e-6)
    assert (a[:, 20:] - b[:, 20:]).abs().amax(dim=-1).min() > 1e-4  # every later position sees the change


def test_model_encodes_positions():
    # Without position encoding, a one-layer causal model's last output would be invariant to
    # permuting the earlier tokens; RoPE must break that.
    torch.manual_seed(0)
    llama = Llama(tiny_config(n_layer=1))
    idx = torch.tensor([[11, 22, 33, 44, 55]])
    with torch.no_grad():
        a, b = llama(idx)[0, -1], llama(idx[:, [1, 0, 2, 3, 4]])[0, -1]
    assert (a - b).abs().max() > 1e-4


def test_rope_depends_only_on_relative_position():
    T, hd = 16, 64
    cos, sin = rope_tables(T, hd, 10000.0, torch.device("cpu"))
    torch.manual_seed(0)
    q = torch.randn(1, 1, 1, hd).expand(1, T, 1, hd)
    k = torch.randn(1, 1, 1, hd).expand(1, T, 1, hd)
    q_rot, k_rot = apply_rope(q, cos, sin)[0, :, 0], apply_rope(k, cos, sin)[0, :, 0]
    scores = q_rot @ k_rot.T
    torch.testing.assert_close(q_rot[0], q[0, 0, 0])  # position 0 is not rotated
    torch.testing.assert_close(q_rot.norm(dim=-1), q[0, :, 0].norm(dim=-1))  # rotations keep norms
    torch.testing.assert_close(scores[5, 2], scores[12, 9])
    torch.testing.assert_close(scores[3, 3], scores[15, 15])
    assert (scores[5, 2] - scores[5, 5]).abs() > 1e-3


def reference_rope(x: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """RoPE written with complex numbers: pair (x_i, x_{i+hd/2}) at position t turns by t·θ^(-2i/hd)."""
    T, hd = x.size(1), x.size(-1)
    angles = torch.arange(T, dtype=torch.float64)[:, None] * theta ** (-torch.arange(0, hd, 2) / hd)
    z = torch.complex(*x.double().chunk(2, dim=-1)) * torch.polar(torch.ones_like(angles), angles)[:, None, :]
    return torch.cat([z.real, z.imag], dim=-1).float()


@pytest.mark.parametrize("n_kv_head", [4, 2, 1])
def test_attention_matches_explicit_causal_softmax(n_kv_head):
    cfg = tiny_config(n_head=4, n_kv_head=n_kv_head)
    H, hd, T = cfg.n_head, cfg.head_dim, 12
    torch.manual_seed(0)
    attn = Attention(cfg)
    x = torch.randn(2, T, cfg.d_model)
    cos, sin = rope_tables(T, hd, cfg.rope_theta, torch.device("cpu"))
    q, k, v = (x @ attn.qkv.weight.T).split([H * hd, n_kv_head * hd, n_kv_head * hd], dim=-1)
    q = reference_rope(q.view(2, T, H, hd)).transpose(1, 2)
    k, v = reference_rope(k.view(2, T, n_kv_head, hd)), v.view(2, T, n_kv_head, hd)
    k, v = (t.repeat_interleave(H // n_kv_head, dim=2).transpose(1, 2) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    expected = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(2, T, H * hd) @ attn.proj.weight.T
    torch.testing.assert_close(attn(x, cos, sin), expected, rtol=1e-4, atol=1e-5)


def test_mlp_is_swiglu_with_up_then_gate_layout():
    cfg = tiny_config()
    torch.manual_seed(0)
    mlp = Llama(cfg).blocks[0].mlp
    x = torch.randn(2, 5, cfg.d_model)
    w_up, w_gate = mlp.up_gate.weight.split(cfg.mlp_hidden)
    expected = (torch.nn.functional.silu(x @ w_gate.T) * (x @ w_up.T)) @ mlp.down.weight.T
    torch.testing.assert_close(mlp(x), expected)


def test_gqa_matches_mha_with_shared_kv_heads():
    d, H, KV = 128, 4, 2
    hd = d // H
    gqa_cfg, mha_cfg = tiny_config(n_head=H, n_kv_head=KV), tiny_config(n_head=H)
    torch.manual_seed(0)
    gqa, mha = Attention(gqa_cfg), Attention(mha_cfg)
    assert gqa.qkv.weight.numel() == d * (H + 2 * KV) * hd
    assert mha.qkv.weight.numel() - gqa.qkv.weight.numel() == 2 * (H - KV) * hd * d
    # An MHA whose key/value heads repeat each GQA head H/KV times (query head h reads kv head h // (H/KV)).
    wq, wk, wv = gqa.qkv.weight.split([H * hd, KV * hd, KV * hd])
    def repeat(w):
        return w.view(KV, hd, d).repeat_interleave(H // KV, dim=0).reshape(H * hd, d)

    with torch.no_grad():
        mha.qkv.weight.copy_(torch.cat([wq, repeat(wk), repeat(wv)]))
        mha.proj.weight.copy_(gqa.proj.weight)
    x = torch.randn(2, 24, d)
    cos, sin = rope_tables(24, hd, 10000.0, torch.device("cpu"))
    torch.testing.assert_close(gqa(x, cos, sin), mha(x, cos, sin))

    llama = Llama(gqa_cfg)
    idx = torch.randint(gqa_cfg.vocab_size, (2, 16))
    assert torch.isfinite(llama(idx, idx))
    full = Llama(mha_cfg)
    assert full.num_params() - llama.num_params() == gqa_cfg.n_layer * 2 * (H - KV) * hd * d


@pytest.mark.parametrize("n_layer", [2, 8])
def test_init_std(n_layer):
    torch.manual_seed(0)
    llama = Llama(tiny_config(n_layer=n_layer))
    residual = 0.02 / math.sqrt(2 * n_layer)
    weights = {"tok_emb.weight": llama.tok_emb.weight, "lm_head.weight": llama.lm_head.weight}
    weights |= {n: p for n, p in llama.blocks.named_parameters(prefix="blocks") if p.dim() == 2}
    assert len(weights) == 2 + 4 * n_layer
    for name, w in weights.items():
        target = residual if name.endswith(("attn.proj.weight", "mlp.down.weight")) else 0.02
        n = w.numel()
        # Sample std of n Gaussians has relative standard error 1/√(2n); sample mean has error std/√n.
        assert abs(w.std().item() / target - 1) < 6 / math.sqrt(2 * n), name
        assert abs(w.mean().item()) < 6 * target / math.sqrt(n), name
    norms = [p for n, p in llama.named_parameters() if p.dim() == 1]
    assert len(norms) == 2 * n_layer + 1 and all(torch.all(p == 1) for p in norms)


def test_meta_build_then_materialise():
    cfg = tiny_config()
    with torch.device("meta"):
        lazy = Llama(cfg)
    assert all(t.is_meta for t in [*lazy.parameters(), *lazy.buffers()])
    lazy.to_empty(device="cpu")
    with torch.no_grad():
        for t in [*lazy.parameters(), *lazy.buffers()]:
            t.fill_(float("nan"))  # init_weights must overwrite every tensor
    torch.manual_seed(1)
    lazy.init_weights()

    eager = Llama(cfg)
    torch.manual_seed(1)
    eager.init_weights()

    assert [(n, type(m)) for n, m in lazy.named_modules()] == [(n, type(m)) for n, m in eager.named_modules()]
    lazy_tensors = dict(lazy.named_parameters()) | dict(lazy.named_buffers())
    eager_tensors = dict(eager.named_parameters()) | dict(eager.named_buffers())
    assert lazy_tensors.keys() == eager_tensors.keys()
    for name, t in lazy_tensors.items():
        assert torch.equal(t, eager_tensors[name]), name

    assert {"rope_cos", "rope_sin"} <= dict(eager.named_buffers()).keys()
    assert not any("rope" in k for k in eager.state_dict())
    assert eager.state_dict().keys() == dict(eager.named_parameters()).keys()

    idx = torch.randint(cfg.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(lazy(idx), eager(idx), rtol=0, atol=0)


def test_flops_per_token_30m():
    llama = build_model(load_preset("30m"), device="meta")
    matmul_params = 6 * (4 * 640**2 + 3 * 640 * 1792) + 32000 * 640  # block linears + lm_head
    assert llama.flops_per_token(512) == 6 * matmul_params + 12 * 6 * 640 * 512


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"d_model": 130, "n_head": 4}, r"d_model \(130\) must be divisible by n_head \(4\)"),
        ({"n_head": 4, "n_kv_head": 3}, r"n_head \(4\) must be divisible by n_kv_head \(3\)"),
        ({"n_layer": 0}, r"n_layer must be a positive integer"),
    ],
)
def test_bad_config_is_rejected(overrides, message):
    with pytest.raises(ValueError, match=message):
        build_model({**load_preset("tiny"), **overrides}, device="meta")


def test_build_model_keys():
    with pytest.raises(ValueError, match=r"unknown model config keys \['n_heads'\]"):
        build_model({**load_preset("tiny"), "n_heads": 4}, device="meta")
    assert build_model({**load_preset("tiny"), "device": "meta"}).lm_head.weight.is_meta


def test_sequence_longer_than_rope_table_is_rejected():
    llama = Llama(tiny_config(max_seq_len=8))
    with pytest.raises(ValueError, match="exceeds max_seq_len 8"):
        llama(torch.zeros(1, 9, dtype=torch.long))


def test_parallelize_rejects_unknown_compile_modes_and_graphs_under_fsdp():
    """An unknown ``compile_mode`` names the choices; a CUDA-graph mode with a device mesh (FSDP2)
    is refused with the fix, before anything is wrapped."""
    from model.parallel import parallelize

    model = build_model(load_preset("tiny"), device="meta")
    with pytest.raises(ValueError, match="unknown compile_mode 'fast'.*reduce-overhead"):
        parallelize(model, None, compile=True, compile_mode="fast")
    with pytest.raises(ValueError, match="FSDP2.*Fix: compile_mode=default"):
        parallelize(model, object(), compile=True, compile_mode="reduce-overhead")
    assert not any(isinstance(b, torch._dynamo.eval_frame.OptimizedModule) for b in model.blocks)
