"""Tests of the NVFP4 export (scripts/export_hf.py --format nvfp4, inference/nvfp4.py, inference/served.py),
checked with compressed-tensors' own code: a tiny run of each scheme, trained a few steps on CPU, is
exported; compressed-tensors' decompression of every quantized linear gives the Ŵ that the trained
model's forward GEMM used (captured from the forward itself), rounded to BF16, with 0 mismatches, and
its codes and E4M3 scales bit for bit; transformers loads the folder and generates; scripts/evaluate.py
scores it."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("compressed_tensors")

from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor  # noqa: E402
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import fake_quantize  # noqa: E402
from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp  # noqa: E402
from conftest import FAST  # noqa: E402

import quant.linear  # noqa: E402
from inference.nvfp4 import as_1x16, bf16_midpoints, input_global_scale, weight_global_scale  # noqa: E402
from inference.served import served_model, trained_model, vllm_activation_qdq  # noqa: E402
from inference.trained_model import consolidate  # noqa: E402
from model.hf import hf_linears  # noqa: E402
from quant.format import E2M1_GRID, NVFP4Tensor  # noqa: E402
from quant.linear import QuantLinear  # noqa: E402
from quant.quantizers import quantize_rtn, quantize_rtn_2d  # noqa: E402
from scripts.export_hf import main  # noqa: E402
from training import trainer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
SCHEMES = ("bf16", "nvidia", "four_over_six", "tetrajet_v2", "quartet2")
EXTRA = {"four_over_six": ["+quant.keep_edge_blocks={first: 1, last: 0}"]}  # block 0 trains in BF16


@pytest.fixture(scope="module")
def runs(compose_train, data_cache, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny run of each scheme, 3 steps on CPU (FP32 master weights, one process)."""
    root = tmp_path_factory.mktemp("nvfp4-runs")
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    out = {}
    try:
        for scheme in SCHEMES:
            cfg = compose_train([*FAST, f"data.cache_dir={data_cache}", f"run_dir={root / scheme}", f"run_root={root}",
                                 f"quant={scheme}", "train.steps=3", "train.eval_every=3", *EXTRA.get(scheme, [])])
            trainer.run(cfg)
            out[scheme] = root / scheme
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return out


@pytest.fixture(scope="module", params=SCHEMES)
def exported(request: pytest.FixtureRequest, runs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """(scheme, run directory, NVFP4 folder with input scales calibrated on 2 validation batches)."""
    out = tmp_path_factory.mktemp(f"nvfp4-{request.param}") / "hf"
    assert main([str(runs[request.param]), str(out), "--format", "nvfp4", "--calib-batches", "2"]) == 0
    return request.param, runs[request.param], out


def forward_pass_weights(run_dir: Path) -> tuple[dict[str, NVFP4Tensor], dict, dict]:
    """Ŵ of each quantized linear as the trained model's forward GEMM received it (the weight operand
    that ``quant.linear.quantized_gemm`` returns for role "forward", during a forward pass), the
    consolidated state and config. A bf16 run's reference is RTN 1x16 of its master weights (SPEC §2)."""
    blob = consolidate(run_dir)
    model = trained_model(blob["model"], blob["config"])
    seen, current = {}, []
    real = quant.linear.quantized_gemm

    def spy(a, b, gemm, role, *args, **kwargs):
        y, qa, qb = real(a, b, gemm, role, *args, **kwargs)
        if role == "forward":
            seen[current[-1]] = qb
        return y, qa, qb

    mp = pytest.MonkeyPatch()
    mp.setattr(quant.linear, "quantized_gemm", spy)
    hooks = [m.register_forward_pre_hook(lambda _m, _a, n=n: current.append(n))
             for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    try:
        with torch.no_grad():
            model(torch.zeros(1, 128, dtype=torch.long))  # quartet2 and tetrajet_v2 check tokens % 128, 32
    finally:
        mp.undo()
        for h in hooks:
            h.remove()
    if blob["config"]["quant"]["name"] == "bf16":
        seen = {n: quantize_rtn(blob["model"][f"{n}.weight"].float()) for n in hf_linears(model.config)
                if n != "lm_head"}
    return seen, blob["model"], blob["config"]


def ct_scheme(folder: Path):
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    return QuantizationConfig.model_validate(config).config_groups["group_0"]


def module_tensors(sd: dict[str, torch.Tensor], module: str) -> dict[str, torch.Tensor]:
    return {k.removeprefix(module + "."): v for k, v in sd.items() if k.startswith(module + ".")}


def test_compressed_tensors_decompresses_the_forward_pass_weights(exported) -> None:
    scheme_name, run_dir, out = exported
    reference, state, config = forward_pass_weights(run_dir)
    expected_bf16 = {"four_over_six": {"blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.up_gate",
                                       "blocks.0.mlp.down"}}.get(scheme_name, set()) | {"lm_head"}
    linears = hf_linears(trained_model(state, config).config)
    assert set(reference) == set(linears) - expected_bf16  # every quantized linear was seen in the forward
    sd, scheme = load_file(out / "model.safetensors"), ct_scheme(out)
    mismatches = 0
    for name, ref in reference.items():
        ref = as_1x16(ref)
        modules = linears[name]
        decompressed = [NVFP4PackedCompressor.decompress(module_tensors(sd, hf), scheme)["weight"] for hf, _ in modules]
        got = torch.cat(decompressed)
        assert got.dtype == torch.bfloat16 and got.shape == ref.q.shape
        mismatches += int((got.view(torch.int16) != ref.dequantize().bfloat16().view(torch.int16)).sum())
        codes = torch.cat([unpack_fp4_from_uint8(sd[f"{hf}.weight_packed"], r, ref.q.shape[1], torch.float32)
                           for hf, r in modules])
        assert torch.equal(codes, ref.q) and torch.equal(codes.signbit(), ref.q.signbit())  # codes, -0 included
        scales = torch.cat([sd[f"{hf}.weight_scale"] for hf, _ in modules])
        assert scales.dtype == torch.float8_e4m3fn
        assert torch.equal(scales.view(torch.uint8), ref.block_scale.to(torch.float8_e4m3fn).view(torch.uint8))
        assert len({sd[f"{hf}.weight_global_scale"].item() for hf, _ in modules}) == 1  # shared by fused shards
        assert all(f"{hf}.input_global_scale" in sd for hf, _ in modules)
    assert mismatches == 0
    record = json.loads((out / "config.json").read_text())
    ignore = record["quantization_config"]["ignore"]
    bf16_modules = {hf for n in expected_bf16 for hf, _ in linears[n]}
    assert set(ignore) == bf16_modules | {"model.embed_tokens"}
    for hf in bf16_modules:
        assert sd[f"{hf}.weight"].dtype == torch.bfloat16 and f"{hf}.weight_packed" not in sd
    assert torch.equal(sd["lm_head.weight"], state["lm_head.weight"].bfloat16())
    export = record["nvfp4_training"]["export"]
    assert export["weights"] == ("rtn_ptq" if scheme_name == "bf16" else "forward")
    assert export["forward_weights_from"] == "float32" and export["bf16_ties_other_neighbour"] == {}


def test_transformers_loads_and_generates(exported) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    scheme_name, run_dir, out = exported
    if scheme_name not in ("bf16", "quartet2"):
        pytest.skip("transformers' loading is the same code for every scheme; two suffice")
    reference, _, _ = forward_pass_weights(run_dir)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("And God said", return_tensors="pt").input_ids
    with torch.no_grad():
        new = model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:]
    assert len(new) == 6
    q = model.model.layers[1].self_attn.q_proj  # decompressed by compressed-tensors on the first forward
    rows = hf_linears(model_config(out))["blocks.1.attn.qkv"][0][1]
    expected = as_1x16(reference["blocks.1.attn.qkv"]).dequantize()[:rows].bfloat16()
    assert torch.equal(q.weight.view(torch.int16), expected.view(torch.int16))
    assert q.quantization_scheme.input_activations is not None  # served W4A4: inputs fake-quantized by CT


def model_config(out: Path):
    from model.hf import llama_config_from_hf

    return llama_config_from_hf(json.loads((out / "config.json").read_text()))


def test_evaluate_runs_on_the_folder(exported, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from scripts import evaluate as evaluate_cli

    scheme_name, _, out = exported
    if scheme_name != "quartet2":
        pytest.skip("one scheme suffices: scripts/evaluate.py reads every NVFP4 folder alike")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    docs = [{"question": "And God said", "choices": [" let there be light", " unto", " the", " and"], "answer": 0}] * 4
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "task.yaml").write_text(
        f"task: nvfp4_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp_path / 'docs.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{question}}\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    res = tmp_path / "res.md"
    assert evaluate_cli.main([str(out), "--tasks", "nvfp4_mc", "--include-path", str(tmp_path), "--device", "cpu",
                              "--out", str(res)]) == 0
    assert json.loads(res.with_suffix(".json").read_text())["nvfp4_mc"]["acc"] in (0.0, 1.0)


def test_served_modes(exported) -> None:
    scheme_name, run_dir, out = exported
    if scheme_name != "nvidia":
        pytest.skip("the served emulation is one code path; the 16x16 scheme exercises as_1x16")
    reference, state, config = forward_pass_weights(run_dir)
    amax = {n: torch.tensor(3.0) for n in reference}
    x = torch.randint(0, 100, (2, 32))
    w4a16 = served_model(state, config, "w4a16", {n: as_1x16(t) for n, t in reference.items()})
    assert torch.equal(w4a16.blocks[0].attn.qkv.weight, reference["blocks.0.attn.qkv"].dequantize())
    w4a4 = served_model(state, config, "w4a4", {n: as_1x16(t) for n, t in reference.items()}, amax)
    bf16 = served_model(state, config, "bf16")
    with torch.no_grad():
        logits = [m(x) for m in (bf16, w4a16, w4a4)]
    assert not torch.equal(logits[0], logits[1]) and not torch.equal(logits[1], logits[2])
    with pytest.raises(ValueError, match="input amax"):
        served_model(state, config, "w4a4", reference)


def test_16x16_tiles_become_1x16_groups_with_the_same_values() -> None:
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(0))
    for four_over_six in (False, True):
        t = quantize_rtn_2d(w, four_over_six=four_over_six)
        g = as_1x16(t)
        assert g.tile == "1x16" and g.block_scale.shape == (48, 4)
        assert torch.equal(g.dequantize(), t.dequantize())


def test_global_scale_reproduces_bf16_ties_where_the_format_can() -> None:
    """Every E4M3 scale with every E2M1 value: the FP32 value nearest 1/s_t misses one tie-free element
    for this s_t, a neighbour does not; for s_t = 7 · 2^-14 (a scale of 3 bits) Ŵ has exact BF16 ties
    that no FP32 1/s_t rounds to even, and they, and only they, come out as the other neighbour."""
    scales = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()[:, None]
    q = torch.cat([E2M1_GRID, -E2M1_GRID])[None, :].expand(len(scales), 16).contiguous()
    nearest_fails = NVFP4Tensor(q=q, block_scale=scales, tensor_scale=torch.tensor(0.0003784179571084678))
    g, ties = weight_global_scale(nearest_fails)
    assert ties == 0 and g.item() != (1.0 / nearest_fails.tensor_scale).item()
    short = NVFP4Tensor(q=q, block_scale=scales, tensor_scale=torch.tensor(7 * 2.0 ** -14))
    g, ties = weight_global_scale(short)
    exact = short.dequantize()
    got = NVFP4PackedCompressor.decompress(
        {"weight_packed": short.pack().data, "weight_scale": short.pack().scales, "weight_global_scale": g},
        QuantizationConfig.model_validate({"config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "float", "group_size": 16, "strategy": "tensor_group", "symmetric": True,
            "dynamic": False}}}, "format": "nvfp4-pack-quantized"}).config_groups["group_0"])["weight"]
    wrong = got.view(torch.int16) != exact.bfloat16().view(torch.int16)
    assert ties == int(wrong.sum()) > 0 and bool(bf16_midpoints(exact)[wrong].all())
    assert (got.float()[wrong] - exact[wrong]).abs().equal((exact.bfloat16().float()[wrong] - exact[wrong]).abs())
    with pytest.raises(ValueError, match="diverged"):
        weight_global_scale(NVFP4Tensor(q=q, block_scale=scales, tensor_scale=torch.tensor(float("nan"))))


def test_activation_emulation_matches_compressed_tensors() -> None:
    """vLLM's activation quantization (emulated) against compressed-tensors' own fake quantization with the
    same static global scale, on activations that partly exceed the calibrated range (they saturate)."""
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * torch.logspace(-2, 1, 64)[:, None]
    amax = x[:32].abs().amax()
    g = input_global_scale(amax)
    args = ct_scheme_nvfp4().input_activations
    scale, zp = compute_dynamic_scales_and_zp(value=x, args=args, module=torch.nn.Module(), global_scale=g)
    theirs = fake_quantize(x=x, scale=scale, zero_point=None, args=args, global_scale=g)
    ours = vllm_activation_qdq(x, g)
    assert (ours != theirs).float().mean().item() < 1e-3  # the block scale's /6 vs ·(1/6) may differ in a tie
    assert ours[32:].abs().amax() > amax  # beyond the range, groups saturate at 448 · 6 / g, not at amax


def ct_scheme_nvfp4():
    from compressed_tensors.quantization import preset_name_to_scheme

    return preset_name_to_scheme("NVFP4", ["Linear"])


def test_errors_name_the_fix(runs: dict[str, Path], data_cache: Path, tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    blob = consolidate(runs["quartet2"])
    pt = tmp_path / "m.pt"
    torch.save(blob | {"config": blob["config"] | {"precision": "bf16"}}, pt)
    assert main([str(pt), str(tmp_path / "a"), "--format", "nvfp4"]) == 1
    assert "--forward-weights" in capsys.readouterr().err
    bad_data = blob["config"] | {"data": blob["config"]["data"] | {"cache_dir": str(tmp_path / "nowhere")}}
    torch.save(blob | {"config": bad_data}, pt)
    tok = ["--tokenizer", str(next(data_cache.glob("sample-*/tokenizer.model")))]
    assert main([str(pt), str(tmp_path / "a"), "--format", "nvfp4", *tok]) == 1
    assert "--calib-batches 0" in capsys.readouterr().err
    assert main([str(pt), str(tmp_path / "a"), "--format", "nvfp4", "--calib-batches", "-1"]) == 1
    assert "--calib-batches" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()
    assert main([str(pt), str(tmp_path / "w"), "--format", "nvfp4", "--calib-batches", "0", *tok]) == 0  # weights only
    config = json.loads((tmp_path / "w" / "config.json").read_text())
    assert config["quantization_config"]["config_groups"]["group_0"]["input_activations"] is None
    assert not any(k.endswith("input_global_scale") for k in load_file(tmp_path / "w" / "model.safetensors"))


def test_served_loss_table(runs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """scripts/served_loss.py: the trained forward's loss is the run's own final validation loss, bit
    for bit (same batches, same FP32 forward); a bf16 run's trained forward is its BF16 master."""
    from scripts import served_loss

    rows = {s: served_loss.served_losses(runs[s], 1) for s in ("bf16", "quartet2")}
    for s, row in rows.items():
        assert row["trained"] == json.loads((runs[s] / "summary.json").read_text())["final_val_loss"]
    assert rows["bf16"]["bf16"] == rows["bf16"]["trained"] and rows["bf16"]["weights"] == "RTN PTQ"
    assert rows["quartet2"]["weights"] == "forward Ŵ"
    assert len({rows["quartet2"][m] for m in ("trained", "bf16", "w4a16", "w4a4")}) == 4
    assert served_loss.main([str(runs["bf16"]), "--calib-batches", "0"]) == 1
    assert "--calib-batches" in capsys.readouterr().err
