"""Broken rollout checkpoints through the real SGLang layers: every one refused at load time, by name.

A tiny valid checkpoint (one Qwen3-MoE expert layer, one q/k/v attention layer, HF tensor names)
is built here, broken one way per case, and loaded the way SGLang's Qwen3-MoE `load_weights`
does it (each parameter's own `weight_loader`, then `process_weights_after_loading`) into
SGLang's FusedMoE / QKVParallelLinear on a 1-rank gloo group. Each case asserts the
CheckpointError and that it names the tensor by its checkpoint name and says what was expected
and found. Config cases go through `QuadsConfig.from_config` and SGLang's own `ModelConfig` /
`get_quant_config`. The valid checkpoint (and one whose E4M3 scales are stored as uint8 bytes)
loads and matches the kernel reference bitwise.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("sglang", reason="SGLang is not installed")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sglang_ext"))

from sglang_fixtures import (TINY_HF, comp_index, init_sglang_runtime, input_scale, load_experts, moe_checkpoint,  # noqa: E402
                             nvfp4_linear)

from quads_megatron.errors import CheckpointError, ConfigError  # noqa: E402
from quads_megatron.integrity import write_manifest  # noqa: E402
from quads_megatron.plan.rollout_schema import RolloutQuantConfig  # noqa: E402
from quads_megatron.kernels import reference  # noqa: E402

E, H, F, TOPK, K = 4, 64, 32, 2, 16
MOE = "model.layers.0.mlp.experts"
ATTN = "model.layers.0.self_attn"


@pytest.fixture(autouse=True)
def torch_kernels(monkeypatch):
    """The forward comparisons run the torch path (fast on CPU); loading is what is tested here."""
    monkeypatch.setenv("QUADS_BACKEND", "torch")


@pytest.fixture(scope="module")
def runtime():
    """SGLang's plugin loading plus world-size-1 gloo model-parallel groups (as tests/sglang_ext)."""
    return init_sglang_runtime()


def _config(mode="w4a4_rac", scaling="per_token"):
    from sglang_ext.config import QuadsConfig

    return QuadsConfig(RolloutQuantConfig(precision=mode, activation_scaling=scaling,
                                          rac_channels=K if mode == "w4a4_rac" else 0))


# --- the tiny valid checkpoint -------------------------------------------------------------
def _moe_ckpt(seed=10) -> dict:
    return moe_checkpoint(E, H, F, K, seed)


def _moe_layer(cfg):
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE

    return FusedMoE(num_experts=E, hidden_size=H, intermediate_size=F, layer_id=0, top_k=TOPK,
                    params_dtype=torch.bfloat16, quant_config=cfg, prefix=MOE)


def _load_moe(layer, ckpt: dict) -> None:
    """The expert branch of SGLang's Qwen3MoeForCausalLM.load_weights, then process."""
    load_experts(layer, ckpt, E)
    layer.quant_method.process_weights_after_loading(layer)


def _qkv_ckpt(seed=3) -> dict:
    out = {}
    for i, (proj, n) in enumerate((("q_proj", 64), ("k_proj", 32), ("v_proj", 32))):
        t = nvfp4_linear(n, H, seed + i)
        t["input_scale"] = input_scale(seed + i)
        t["input_comp_index"] = comp_index(H, K, seed + i)
        out.update({f"{proj}.{k}": v for k, v in t.items()})
    return out


def _qkv_layer(cfg):
    from sglang.srt.layers.linear import QKVParallelLinear

    return QKVParallelLinear(H, 16, 4, 2, bias=False, params_dtype=torch.bfloat16, quant_config=cfg,
                             prefix=f"{ATTN}.qkv_proj")


def _load_qkv(layer, ckpt: dict) -> None:
    """The stacked-params branch of SGLang's load_weights: q/k/v_proj.* -> qkv_proj.* with a shard id."""
    for name, t in ckpt.items():
        proj, key = name.split(".", 1)
        p = getattr(layer, key, None)
        if p is not None:
            p.weight_loader(p, t, proj[0])
    layer.quant_method.process_weights_after_loading(layer)


def _routed():
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, H, generator=g).to(torch.bfloat16)
    logits = torch.randn(6, E, generator=g)
    w, ids = torch.topk(torch.softmax(logits, -1), TOPK, dim=-1)
    return x, StandardTopKOutput(w / w.sum(-1, keepdim=True), ids.to(torch.int32), logits)


def _moe_reference(x, topk, ckpt):
    def stack(key, projs):
        return torch.stack([torch.cat([ckpt[f"experts.{e}.{p}.{key}"] for p in projs]) for e in range(E)])

    return reference.w4a4_fused_moe(
        x, stack("weight", ("gate_proj", "up_proj")), stack("weight_scale", ("gate_proj", "up_proj")),
        torch.stack([ckpt[f"experts.{e}.gate_proj.weight_scale_2"] for e in range(E)]),
        stack("weight", ["down_proj"]), stack("weight_scale", ["down_proj"]),
        torch.stack([ckpt[f"experts.{e}.down_proj.weight_scale_2"] for e in range(E)]),
        topk.topk_weights, topk.topk_ids, act_mode="w4a4_rac",
        w13_comp_index=ckpt["experts.0.gate_proj.input_comp_index"],
        w2_comp_index=torch.stack([ckpt[f"experts.{e}.down_proj.input_comp_index"] for e in range(E)]))


# --- valid checkpoints load and match the reference --------------------------------------------
def test_valid_checkpoint_loads_and_matches_reference(runtime):
    ckpt = _moe_ckpt()
    layer = _moe_layer(_config())
    _load_moe(layer, ckpt)
    x, topk = _routed()
    torch.testing.assert_close(layer(x, topk), _moe_reference(x, topk, ckpt), rtol=0, atol=0)


def test_uint8_weight_scale_bytes_are_reinterpreted_not_converted(runtime):
    """ModelOpt checkpoints may store the E4M3 bytes as uint8: same output as the float8 checkpoint."""
    ckpt = _moe_ckpt()
    as_bytes = {n: (t.view(torch.uint8) if n.endswith(".weight_scale") else t) for n, t in ckpt.items()}
    layer = _moe_layer(_config())
    _load_moe(layer, as_bytes)
    x, topk = _routed()
    torch.testing.assert_close(layer(x, topk), _moe_reference(x, topk, ckpt), rtol=0, atol=0)


# --- broken expert tensors: refused at load, by HF name -------------------------------------
def _nan_bytes(t, byte):
    bits = t.view(torch.uint8).clone()
    bits[3, 1] = byte
    return bits.view(torch.float8_e4m3fn)


def _unsorted(t):
    t = t.clone()
    t[[0, 1]] = t[[1, 0]]
    return t


def _duplicated(t):
    t = t.clone()
    t[1] = t[0]
    return t


MOE_CASES = {
    "missing up_proj.weight": (
        lambda c: c.pop("experts.2.up_proj.weight"),
        rf"^{MOE}\.2\.up_proj\.weight: missing from the checkpoint"),
    "missing weight_scale": (
        lambda c: c.pop("experts.1.down_proj.weight_scale"),
        rf"^{MOE}\.1\.down_proj\.weight_scale: missing from the checkpoint"),
    "missing weight_scale_2": (
        lambda c: c.pop("experts.0.gate_proj.weight_scale_2"),
        rf"^{MOE}\.0\.gate_proj\.weight_scale_2: missing from the checkpoint"),
    "half-width weight": (
        lambda c: c.update({"experts.0.gate_proj.weight": c["experts.0.gate_proj.weight"][:, :16]}),
        rf"^{MOE}\.0\.gate_proj\.weight: expected shape \[32, 32\] .*got \(32, 16\)"),
    "weight_scale as float32": (
        lambda c: c.update({"experts.3.up_proj.weight_scale": c["experts.3.up_proj.weight_scale"].float()}),
        rf"^{MOE}\.3\.up_proj\.weight_scale: expected float8_e4m3fn block scales .*got torch.float32"),
    "weight as int8": (
        lambda c: c.update({"experts.1.gate_proj.weight": c["experts.1.gate_proj.weight"].view(torch.int8)}),
        rf"^{MOE}\.1\.gate_proj\.weight: expected packed NVFP4 codes as uint8"),
    "inf weight_scale_2": (
        lambda c: c.update({"experts.3.down_proj.weight_scale_2": torch.tensor(float("inf"))}),
        rf"^{MOE}\.3\.down_proj\.weight_scale_2: expected a finite, positive scale, got inf"),
    "nan weight_scale_2": (
        lambda c: c.update({"experts.2.gate_proj.weight_scale_2": torch.tensor(float("nan"))}),
        rf"^{MOE}\.2\.gate_proj\.weight_scale_2: expected a finite, positive scale, got nan"),
    "zero weight_scale_2": (
        lambda c: c.update({"experts.2.up_proj.weight_scale_2": torch.tensor(0.0)}),
        rf"^{MOE}\.2\.up_proj\.weight_scale_2: expected a finite, positive scale, got 0.0"),
    "negative input_scale": (
        lambda c: c.update({"experts.1.down_proj.input_scale": torch.tensor(-0.5)}),
        rf"^{MOE}\.1\.down_proj\.input_scale: expected a finite, positive scale, got -0.5"),
    "inf input_scale": (
        lambda c: c.update({"experts.0.up_proj.input_scale": torch.tensor(float("inf"))}),
        rf"^{MOE}\.0\.up_proj\.input_scale: expected a finite, positive scale, got inf"),
    "nan scale byte 0x7F": (
        lambda c: c.update({"experts.2.down_proj.weight_scale": _nan_bytes(c["experts.2.down_proj.weight_scale"], 0x7F)}),
        rf"^{MOE}\.2\.down_proj\.weight_scale: 1 block scales are E4M3 NaN bytes \(0x7F/0xFF\), first at \(3, 1\)"),
    "nan scale byte 0xFF": (
        lambda c: c.update({"experts.0.gate_proj.weight_scale": _nan_bytes(c["experts.0.gate_proj.weight_scale"], 0xFF)}),
        rf"^{MOE}\.0\.gate_proj\.weight_scale: 1 block scales are E4M3 NaN bytes"),
    "rac index out of range": (
        lambda c: c["experts.1.down_proj.input_comp_index"].__setitem__(-1, F),
        rf"^{MOE}\.1\.down_proj\.input_comp_index: RAC channel index out of range \[0, 32\): .*max 32"),
    "rac index negative": (
        lambda c: c["experts.0.gate_proj.input_comp_index"].__setitem__(0, -3),
        rf"^{MOE}\.0\.gate_proj\.input_comp_index: RAC channel index out of range \[0, 64\): min -3"),
    "rac index duplicated": (
        lambda c: c.update({"experts.2.down_proj.input_comp_index": _duplicated(c["experts.2.down_proj.input_comp_index"])}),
        rf"^{MOE}\.2\.down_proj\.input_comp_index: RAC channel indices must be unique"),
    "rac index unsorted": (
        lambda c: c.update({"experts.3.up_proj.input_comp_index": _unsorted(c["experts.3.up_proj.input_comp_index"])}),
        rf"^{MOE}\.3\.up_proj\.input_comp_index: RAC channel indices must be sorted ascending"),
    "rac index wrong count": (
        lambda c: c.update({"experts.0.down_proj.input_comp_index": comp_index(F, 32, 1)}),
        rf"^{MOE}\.0\.down_proj\.input_comp_index: expected 16 RAC channel indices .*got 32"),
    "rac index as float": (
        lambda c: c.update({"experts.0.down_proj.input_comp_index": c["experts.0.down_proj.input_comp_index"].float()}),
        rf"^{MOE}\.0\.down_proj\.input_comp_index: expected int32 \[16\] RAC channel indices, got torch.float32"),
    "missing input_comp_index": (
        lambda c: c.pop("experts.2.gate_proj.input_comp_index"),
        rf"^{MOE}\.2\.gate_proj\.input_comp_index: missing from the checkpoint \(precision 'w4a4_rac'"),
    "fc1 rac sets differ by expert": (
        lambda c: c.update({"experts.1.gate_proj.input_comp_index": comp_index(H, K, 99),
                            "experts.1.up_proj.input_comp_index": comp_index(H, K, 99)}),
        rf"^{MOE}\.w13_input_comp_index: fc1 reads the same hidden states for every expert"),
    "gate/up global scales differ": (
        lambda c: c.update({"experts.2.up_proj.weight_scale_2": c["experts.2.up_proj.weight_scale_2"] * 2}),
        rf"^{MOE}\.w13_weight_scale_2: gate and up of experts \[2\] have different global scales"),
}


@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_broken_expert_tensor_is_refused_at_load(runtime, case):
    breaks, match = MOE_CASES[case]
    ckpt = _moe_ckpt()
    breaks(ckpt)
    layer = _moe_layer(_config())
    with pytest.raises(CheckpointError, match=match):
        _load_moe(layer, ckpt)


def test_missing_static_input_scale_is_named(runtime):
    ckpt = _moe_ckpt()
    del ckpt["experts.3.down_proj.input_scale"]
    layer = _moe_layer(_config("w4a4", "static"))
    with pytest.raises(CheckpointError, match=rf"^{MOE}\.3\.down_proj\.input_scale: missing .*'static'"):
        _load_moe(layer, ckpt)


def test_rac_index_checks_are_not_repeated_per_forward(runtime, monkeypatch):
    """Validated at load, so the forward calls the real kernel without its host-syncing value checks."""
    import sglang_ext.moe_method as mm

    seen, real = [], mm.w4a4_fused_moe

    def recording(*args, **kwargs):
        seen.append(kwargs.get("check_inputs"))
        return real(*args, **kwargs)

    ckpt = _moe_ckpt()
    layer = _moe_layer(_config())
    _load_moe(layer, ckpt)
    x, topk = _routed()
    monkeypatch.setattr(mm, "w4a4_fused_moe", recording)
    torch.testing.assert_close(layer(x, topk), _moe_reference(x, topk, ckpt), rtol=0, atol=0)
    assert seen == [False]


# --- broken attention tensors (QKVParallelLinear: q/k/v shards) ------------------------------
QKV_CASES = {
    "missing k_proj.weight": (
        lambda c: c.pop("k_proj.weight"), rf"^{ATTN}\.k_proj\.weight: missing from the checkpoint"),
    "missing v_proj.weight_scale": (
        lambda c: c.pop("v_proj.weight_scale"), rf"^{ATTN}\.v_proj\.weight_scale: missing from the checkpoint"),
    "half-width v_proj.weight": (
        lambda c: c.update({"v_proj.weight": c["v_proj.weight"][:, :16]}),
        rf"^{ATTN}\.v_proj\.weight: expected shape \[32, 32\] .*got \(32, 16\)"),
    "short q_proj.weight_scale": (
        lambda c: c.update({"q_proj.weight_scale": c["q_proj.weight_scale"][:, :1]}),
        rf"^{ATTN}\.q_proj\.weight_scale: expected shape \[64, 4\] .*got \(64, 1\)"),
    "inf q_proj.input_scale": (
        lambda c: c.update({"q_proj.input_scale": torch.tensor(float("inf"))}),
        rf"^{ATTN}\.q_proj\.input_scale: expected a finite, positive scale, got inf"),
    "unsorted k_proj.input_comp_index": (
        lambda c: c.update({"k_proj.input_comp_index": _unsorted(c["k_proj.input_comp_index"])}),
        rf"^{ATTN}\.k_proj\.input_comp_index: RAC channel indices must be sorted ascending"),
    "missing v_proj.input_comp_index": (
        lambda c: c.pop("v_proj.input_comp_index"), rf"^{ATTN}\.v_proj\.input_comp_index: missing from the checkpoint"),
}


@pytest.mark.parametrize("case", sorted(QKV_CASES))
def test_broken_attention_tensor_is_refused_at_load(runtime, case):
    breaks, match = QKV_CASES[case]
    ckpt = _qkv_ckpt()
    breaks(ckpt)
    layer = _qkv_layer(_config())
    with pytest.raises(CheckpointError, match=match):
        _load_qkv(layer, ckpt)


def test_valid_attention_checkpoint_matches_reference(runtime):
    ckpt = _qkv_ckpt()
    layer = _qkv_layer(_config())
    _load_qkv(layer, ckpt)
    x = _routed()[0]
    want = torch.cat([reference.w4a4_linear(x, ckpt[f"{p}.weight"], ckpt[f"{p}.weight_scale"], ckpt[f"{p}.weight_scale_2"],
                                            act_mode="w4a4_rac", comp_index=ckpt[f"{p}.input_comp_index"])
                      for p in ("q_proj", "k_proj", "v_proj")], dim=-1)
    torch.testing.assert_close(layer(x)[0], want, rtol=0, atol=0)


def test_rac_channels_larger_than_the_layer_input_is_refused(runtime):
    from sglang_ext.config import QuadsConfig

    cfg = QuadsConfig(RolloutQuantConfig(precision="w4a4_rac", rac_channels=128))
    with pytest.raises(CheckpointError, match=rf"rac_channels: 128 exceeds the 64 input channels of {MOE}"):
        _moe_layer(cfg)


# --- the quantization config (QuadsConfig.from_config: SGLang's hand-off) -------------------
def _quads(**over):
    qc = RolloutQuantConfig(precision="w4a4_rac", rac_channels=K, exclude_modules=["lm_head"]).to_quantization_config()
    qc.update(over)
    return {k: v for k, v in qc.items() if v is not None}


CONFIG_CASES = {
    "exclude_modules string": (_quads(exclude_modules="lm_head"),
                               r"^hf_quant_config\.json\.exclude_modules: .*got the string 'lm_head' \(write \['lm_head'\]\)"),
    "rac_index_tensor unknown": (_quads(rac_index_tensor="rac_idx"),
                                 r"^hf_quant_config\.json\.rac_index_tensor: .*'input_comp_index' only, got 'rac_idx'"),
    "unknown key": (_quads(input_comp=1), r"^hf_quant_config\.json: unknown quads keys \['input_comp'\]"),
    "missing quant_method": ({"quant_algo": "NVFP4", "group_size": 16},
                             r"^hf_quant_config\.json\.quant_method: missing .*refusing to guess"),
    "quads block without quant_method": ({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4"},
                                          "quads": {"quant_algo": "NVFP4", "precision": "w4a4_rac", "rac_channels": 16}},
                                         r"^hf_quant_config\.json\.quads\.quant_method: the quads block must say 'quads'"),
    "wrong quant_algo": (_quads(quant_algo="FP8"), r"^hf_quant_config\.json\.quant_algo: expected 'NVFP4', got 'FP8'"),
    "modelopt wrong quant_algo": ({"quant_method": "modelopt", "quant_algo": "INT4_AWQ"},
                                  r"^hf_quant_config\.json\.quant_algo: .*got 'INT4_AWQ'"),
    "missing quant_algo (modelopt)": ({"quant_method": "modelopt"}, r"^hf_quant_config\.json\.quant_algo: .*got None"),
    "unknown precision": (_quads(precision="w8a8"), r"^hf_quant_config\.json\.precision: 'w8a8' is not one of"),
    "precision not a string": (_quads(precision=4), r"^hf_quant_config\.json\.precision: 4 is not one of"),
    "missing precision": ({"quant_method": "quads", "rac_channels": 16}, r"^hf_quant_config\.json\.precision: missing"),
    "rac_channels not a multiple of 16": (_quads(rac_channels=20), r"^hf_quant_config\.json\.rac_channels: .*multiple of 16.*got 20"),
    "rac_channels as a string": (_quads(rac_channels="16"), r"^hf_quant_config\.json\.rac_channels: .*got '16'"),
    "rac_channels zero with rac": (_quads(rac_channels=0), r"^hf_quant_config\.json\.rac_channels: precision 'w4a4_rac' needs"),
    "group_size 32": (_quads(group_size=32), r"^hf_quant_config\.json\.group_size: NVFP4 uses the integer 16, got 32"),
    "group_size as a string": ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": "16"},
                               r"^hf_quant_config\.json\.group_size: .*got '16'"),
    "activation_scaling unknown": (_quads(activation_scaling="per_channel"),
                                   r"^hf_quant_config\.json\.activation_scaling: 'per_channel' is not one of"),
    "exclude_modules of ints": (_quads(exclude_modules=[1]), r"^hf_quant_config\.json\.exclude_modules: expected a list"),
    "modelopt exclude string": ({"quant_method": "modelopt", "quant_algo": "NVFP4", "exclude_modules": "lm_head"},
                                r"^hf_quant_config\.json\.exclude_modules: .*got the string 'lm_head'"),
    "not an object": ([1, 2], r"^hf_quant_config\.json: expected a JSON object, got list"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_bad_quantization_config_is_refused_by_field(runtime, case):
    """Through the schema and through QuadsConfig.from_config (no hf_config: the hf_quant_config.json path)."""
    from sglang_ext.config import QuadsConfig

    from quads_megatron.plan.rollout_schema import parse_quantization_config

    cfg, match = CONFIG_CASES[case]
    with pytest.raises(CheckpointError, match=match):
        parse_quantization_config(cfg, origin="hf_quant_config.json")
    if isinstance(cfg, dict):
        with pytest.raises(CheckpointError, match=match):
            QuadsConfig.from_config({**cfg, "packed_modules_mapping": {}})


def test_a_server_flag_that_disagrees_with_the_checkpoint_is_a_config_error(runtime):
    """The checkpoint is the only switch: SGLang's `--quantization` naming another method than the checkpoint's
    is refused by the quads override with both values named (before SGLang's own generic check)."""
    from sglang_ext.config import QuadsConfig

    with pytest.raises(ConfigError, match=r"--quantization modelopt_fp4: .* says quant_method 'quads'"):
        QuadsConfig.override_quantization_method(_quads(), "modelopt_fp4")
    with pytest.raises(ConfigError, match=r"--quantization quads: .* says quant_method 'fp8'"):
        QuadsConfig.override_quantization_method({"quant_method": "fp8"}, "quads")


# --- a model directory through SGLang's ModelConfig: file names and the manifest ------------
def _model_dir(tmp_path, qc) -> Path:
    from transformers import Qwen3MoeConfig

    d = tmp_path / "model"
    d.mkdir()
    cfg = Qwen3MoeConfig(**TINY_HF).to_dict()
    cfg["architectures"] = ["Qwen3MoeForCausalLM"]
    cfg["quantization_config"] = qc
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model.safetensors").write_bytes(bytes(range(256)) * 8)  # only hashed here, never read
    write_manifest(d)
    return d


def _sglang_quant_config(path):
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.weight_utils import get_quant_config

    return get_quant_config(ModelConfig(model_path=str(path), quantization="quads"), LoadConfig(), {})


def test_model_dir_with_a_valid_manifest_loads(runtime, tmp_path):
    qc = _sglang_quant_config(_model_dir(tmp_path, _quads()))
    assert qc.rollout.precision == "w4a4_rac" and qc.rollout.rac_channels == K


def test_flipped_byte_is_named_before_any_layer_is_built(runtime, tmp_path):
    d = _model_dir(tmp_path, _quads())
    blob = bytearray((d / "model.safetensors").read_bytes())
    blob[100] ^= 0xFF
    (d / "model.safetensors").write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match=rf"{d / 'model.safetensors'}: SHA-256 does not match quads_manifest.json"):
        _sglang_quant_config(d)


def test_config_json_field_error_names_the_file(runtime, tmp_path):
    d = _model_dir(tmp_path, _quads(rac_channels=20))
    with pytest.raises(CheckpointError, match=rf"^{d / 'config.json'} quantization_config\.rac_channels: .*got 20"):
        _sglang_quant_config(d)


# --- issue 26: the manifest is the list of what may be read; ours without it is refused ----
PRODUCED = {"name": "quads-megatron", "version": "0.1.0"}


def test_our_export_without_its_manifest_is_refused(runtime, tmp_path):
    d = _model_dir(tmp_path, {**_quads(), "producer": PRODUCED})
    (d / "quads_manifest.json").unlink()
    with pytest.raises(CheckpointError, match=rf"{d / 'quads_manifest.json'}: missing, but .*producer says QUADS"):
        _sglang_quant_config(d)


def test_someone_elses_checkpoint_without_a_manifest_loads(runtime, tmp_path):
    d = _model_dir(tmp_path, _quads())
    (d / "quads_manifest.json").unlink()
    assert _sglang_quant_config(d).rollout.precision == "w4a4_rac"


def test_weight_file_not_listed_in_the_manifest_is_refused(runtime, tmp_path):
    d = _model_dir(tmp_path, _quads())
    (d / "model-extra.safetensors").write_bytes(b"\0" * 64)
    with pytest.raises(CheckpointError, match=rf"{d / 'model-extra.safetensors'}: not listed in"):
        _sglang_quant_config(d)


def test_weight_file_symlinked_out_of_the_directory_is_refused(runtime, tmp_path):
    d = _model_dir(tmp_path, _quads())
    (d / "quads_manifest.json").unlink()
    (tmp_path / "elsewhere.safetensors").write_bytes((d / "model.safetensors").read_bytes())
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(CheckpointError, match=rf"{d / 'model.safetensors'}: resolves to .*outside"):
        _sglang_quant_config(d)
