"""quant/fsdp_gather.py in one process: a shard quantized with the whole weight's amax is those
rows of Ŵ; which layers fall back to the BF16 gather; the shard and gathered tensors' rules.
(The FSDP2 runs on 2 ranks are in tests/test_distributed.py.)"""

from __future__ import annotations

import pytest
import torch

from quant import QuantLinear, get_scheme
from quant.fsdp_gather import NVFP4ShardedWeight, fallback_reason, refresh, whole_amax
from quant.gathered import GatheredNVFP4Weight
from quant.linear import quantize_forward_weight

SCHEMES = ["nvidia", "four_over_six", "tetrajet_v2", "quartet2"]


def _weight(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(rows * 1000 + cols)
    w = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 1, cols)[torch.randperm(cols, generator=g)]
    w[rows // 3, 5] = 40.0  # the whole weight's amax lies in one shard only
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("shards", [2, 4])
def test_shards_quantized_with_the_whole_amax_are_the_rows_of_w_hat(scheme, shards, dtype):
    s = get_scheme(scheme)
    w = _weight(128, 96, dtype)
    whole = quantize_forward_weight(w, s).pack()
    parts = list(w.chunk(shards))
    amax = whole_amax(parts, None).max()  # one process: the max over the shards is the all-reduce
    packed = [quantize_forward_weight(p, s, amax=amax).pack() for p in parts]
    assert torch.equal(torch.cat([p.data for p in packed]), whole.data)
    assert torch.equal(torch.cat([p.scales for p in packed]).view(torch.uint8), whole.scales.view(torch.uint8))
    assert all(torch.equal(p.tensor_scale, whole.tensor_scale) for p in packed)
    own = quantize_forward_weight(parts[-1], s).pack()  # without the whole amax the scales differ
    assert not torch.equal(own.tensor_scale, whole.tensor_scale)


def test_whole_amax_propagates_nan_and_inf():
    a = torch.tensor([[1.0, -3.0]])
    assert whole_amax([a, torch.tensor([[float("nan"), 0.0]]), torch.tensor([[float("-inf")]])], None).tolist()[1:] == \
        pytest.approx([float("nan"), float("inf")], nan_ok=True)
    assert whole_amax([a], None).item() == 3.0


def _linear(scheme: str, out_features: int, **switches) -> QuantLinear:
    return QuantLinear(64, out_features, scheme=get_scheme(scheme, **switches), name="blocks.0.mlp.down", device="meta")


def test_fallback_reasons_name_the_cause():
    assert fallback_reason(_linear("quartet2", 128), 4) is None
    assert fallback_reason(_linear("nvidia", 64), 4) is None  # 16 rows per shard: whole tiles
    assert "16-row tiles" in fallback_reason(_linear("nvidia", 64), 8)  # 8 rows per shard
    assert "equal shards" in fallback_reason(_linear("quartet2", 128), 3)
    assert "delayed_amax" in fallback_reason(_linear("nvidia", 64, delayed_amax=True, range_alignment="amax"), 2)
    assert "not quantized" in fallback_reason(_linear("quartet2", 128, forward=False), 2)


def test_a_write_to_a_shard_or_its_view_makes_it_stale():
    w = NVFP4ShardedWeight(_weight(32, 64, torch.float32), get_scheme("quartet2"), None)
    assert w.stale and refresh([w], None) == 1 and not w.stale and refresh([w], None) == 0
    q = w.quantized(None)
    assert torch.equal(q.data, quantize_forward_weight(w.hp, w.scheme).pack().data)
    view = w.view(-1)
    assert isinstance(view, NVFP4ShardedWeight) and not view.stale  # a view shares the quantized form
    fresh = torch.empty_like(w)
    assert isinstance(fresh, NVFP4ShardedWeight) and fresh.stale  # new values: none yet
    view.mul_(2.0)
    assert w.stale and torch.equal(w.hp, 2 * _weight(32, 64, torch.float32))
    plain = w + 1  # arithmetic gives plain tensors (optimizer states, norms)
    assert type(plain) is torch.Tensor


def test_the_gathered_weight_refuses_to_be_read_as_w():
    s = get_scheme("quartet2")
    p = quantize_forward_weight(_weight(32, 64, torch.float32), s).pack()
    g = GatheredNVFP4Weight(p.data, p.scales, p.tensor_scale, p.tile, torch.bfloat16, s.forward.b)
    assert g.shape == (32, 64) and g.dtype == torch.bfloat16
    assert torch.equal(g.detach().packed.data, p.data)
    assert g.serves(s.forward.b) and not g.serves(get_scheme("nvidia").forward.b)
    assert not g.serves(get_scheme("quartet2", forward=False).forward.b)  # a forward switched to BF16
    with pytest.raises(RuntimeError, match="holds only its forward NVFP4 form"):
        g.sum()
