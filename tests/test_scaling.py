"""The run-time model of docs/scaling.md (analysis/scaling.py): its bytes per rank and step, and
which of compute and communication bounds the step."""

from __future__ import annotations

import pytest

from analysis.scaling import Links, parameter_count, step

LINKS = Links(nvlink=400e9, network=50e9)


def test_fsdp_within_a_node_gathers_twice_per_micro_batch_and_reduces_once():
    s = step(1000, 1e4, gpus=8, gpus_per_node=8, batch=512, seq_len=512, micro_batch=32, links=LINKS, hsdp=False)
    assert s.layout == "FSDP" and s.accum == 2
    assert s.gathered_bytes == pytest.approx(2 * 2 * 2 * 1000 * 7 / 8)
    assert s.reduced_bytes == pytest.approx(4 * 1000 * 7 / 8)
    assert s.comm_s == pytest.approx((s.gathered_bytes + s.reduced_bytes) / 400e9)
    assert s.compute_s == pytest.approx(64 * 512 / 1e4) and s.bound == "compute"


def test_hsdp_shards_within_nodes_and_all_reduces_the_shard_between_them():
    s = step(8000, 1e12, gpus=64, gpus_per_node=8, batch=512, seq_len=512, micro_batch=32, links=LINKS, hsdp=True)
    assert s.layout == "HSDP" and s.accum == 1
    replica = 2 * 4 * 8000 / 8 * 7 / 8
    assert s.reduced_bytes == pytest.approx(4 * 8000 * 7 / 8 + replica)
    assert s.comm_s == pytest.approx((2 * 2 * 8000 * 7 / 8 + 4 * 8000 * 7 / 8) / 400e9 + replica / 50e9)
    assert s.bound == "communication" and s.time_s == s.comm_s


def test_a_batch_that_does_not_split_is_refused():
    with pytest.raises(ValueError, match="does not split"):
        step(1000, 1e4, gpus=3, gpus_per_node=8, batch=512, seq_len=512, micro_batch=32, links=LINKS, hsdp=False)


def test_parameter_count_of_a_preset():
    tiny = {"vocab_size": 64, "n_layer": 1, "d_model": 32, "n_head": 2, "mlp_hidden": 64, "max_seq_len": 16}
    # embedding + lm_head 2·64·32, qkv 32·96, proj 32·32, up_gate 32·128, down 64·32, 3 norms of 32
    assert parameter_count(tiny) == 2 * 64 * 32 + 32 * 96 + 32 * 32 + 32 * 128 + 64 * 32 + 3 * 32


def test_the_nvfp4_gather_moves_the_block_linears_in_4_5_bits():
    from analysis.scaling import gather_bytes

    tiny = {"vocab_size": 64, "n_layer": 1, "d_model": 128, "n_head": 2, "mlp_hidden": 256, "max_seq_len": 16}
    linears = 128 * 384 + 128 * 128 + 128 * 512 + 256 * 128
    bf16, nvfp4 = (gather_bytes(tiny, "quartet2", g, 8) for g in ("bf16", "nvfp4"))
    assert bf16 == {"quantized_linears": 2 * linears, "other": 2 * (2 * 64 * 128 + 3 * 128)}
    assert nvfp4 == {"quantized_linears": linears * 9 // 16, "other": bf16["other"]}
    assert gather_bytes(tiny, "nvidia", "nvfp4", 8)["quantized_linears"] == linears // 2 + linears // 256
    s = step(1000, 1e4, gpus=8, gpus_per_node=8, batch=512, seq_len=512, micro_batch=32, links=LINKS, hsdp=False,
             gather=sum(nvfp4.values()))
    assert s.gathered_bytes == pytest.approx(2 * 2 * sum(nvfp4.values()) * 7 / 8)
