"""tools/sglang_h200.py's dummy-weight model directories are what SGLang reads: config.json alone, and for QUADS
the quantization_config an export of the same plan writes (parsed by SGLang's own get_quant_config)."""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_dummy_model_dirs(load_tool, tmp_path):
    pytest.importorskip("megatron.core", reason="megatron-core builds the benchmark's config")
    tool = load_tool("sglang_h200")
    cfg = tool.model_config(num_layers=48)
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_experts"], cfg["moe_intermediate_size"]) == \
        (48, 2048, 128, 768)
    bf16 = tool.dummy_model(tmp_path, cfg, None, 64)
    assert sorted(p.name for p in bf16.iterdir()) == ["config.json"]
    conf = json.loads((bf16 / "config.json").read_text())
    assert "quantization_config" not in conf and conf["num_hidden_layers"] == 48
    rac = tool.dummy_model(tmp_path, cfg, "w4a4_rac", 64)
    qc = json.loads((rac / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["precision"], qc["rac_channels"]) == ("quads", "w4a4_rac", 64)
    assert "producer" not in qc  # nothing our exporter wrote, so no manifest is asked for
    assert any("self_attn" in m for m in qc["exclude_modules"])  # the plan's carve-outs, as an export has them


def test_dummy_quads_dir_parses_in_sglang(load_tool, tmp_path):
    pytest.importorskip("megatron.core", reason="megatron-core builds the benchmark's config")
    pytest.importorskip("sglang", reason="SGLang is not installed")
    sys.path.insert(0, os.path.join(ROOT, "tests", "sglang_ext"))
    from sglang_fixtures import init_sglang_runtime

    init_sglang_runtime()  # what SGLang's scheduler does first: the plugin (`--quantization quads`) registered
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.weight_utils import get_quant_config

    from sglang_ext.config import QuadsConfig

    tool = load_tool("sglang_h200")
    model = tool.dummy_model(tmp_path, tool.model_config(num_layers=2), "w4a4", 0)
    qc = get_quant_config(ModelConfig(model_path=str(model), quantization="quads"), LoadConfig(load_format="dummy"), {})
    assert isinstance(qc, QuadsConfig) and qc.rollout.precision.value == "w4a4" and not qc.rollout.uses_rac
