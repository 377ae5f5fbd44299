"""`--quantization quads` through SGLang's plugin entry point: CLI, server args, registry, ModelConfig.

The two CLI checks run `python -m sglang.launch_server` in subprocesses (started together,
~15 s each on CPU); everything else runs in this process against the real SGLang modules.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed")

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def launch_server_runs(checkpoints):
    """(help run, run with our plugin excluded by SGLANG_PLUGINS), started in parallel."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("SGLANG_PLUGINS", None)
    cmd = [sys.executable, "-m", "sglang.launch_server"]
    procs = [
        subprocess.Popen(cmd + ["--help"], env=env, cwd=REPO, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE),
        subprocess.Popen(cmd + ["--model-path", str(checkpoints["quads"]), "--quantization", "quads"],
                         env={**env, "SGLANG_PLUGINS": "some_other_plugin"}, cwd=REPO, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE),
    ]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        out.append((p.returncode, stdout, stderr))
    return out


def test_launch_server_help_lists_quads(launch_server_runs):
    rc, stdout, stderr = launch_server_runs[0]
    assert rc == 0, stderr[-2000:]
    start = stdout.index("--quantization")
    choices = stdout[start:stdout.index("}", start)]
    assert "quads" in choices and "modelopt_fp4" in choices


def test_quads_is_rejected_when_sglang_plugins_excludes_it(launch_server_runs):
    rc, _, stderr = launch_server_runs[1]
    assert rc == 2, stderr[-2000:]
    assert "invalid choice: 'quads'" in stderr


def test_server_args_accept_quads(sglang_runtime, checkpoints):
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(["--model-path", str(checkpoints["quads"]), "--quantization", "quads"])
    assert args.quantization == "quads"


def test_registration_is_idempotent_and_first(sglang_runtime):
    from sglang.srt.arg_groups.choices import QUANTIZATION_CHOICES
    from sglang.srt.layers import linear
    from sglang.srt.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    from sglang_ext.config import QuadsConfig
    from sglang_ext.plugin import register

    n_methods = len(QUANTIZATION_METHODS)
    register()
    register()
    assert next(iter(QUANTIZATION_METHODS)) == "quads"
    assert len(QUANTIZATION_METHODS) == n_methods
    assert QUANTIZATION_CHOICES.count("quads") == 1
    assert linear.WEIGHT_LOADER_V2_SUPPORTED.count("QuadsLinearMethod") == 1
    assert get_quantization_config("quads") is QuadsConfig
    assert QuadsConfig.get_min_capability() == 90


def _model_config(path, quantization):
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.weight_utils import get_quant_config

    mc = ModelConfig(model_path=str(path), quantization=quantization)
    return mc.quantization, get_quant_config(mc, LoadConfig(), {})


@pytest.mark.parametrize("kind,flag,want_method,want_source", [
    ("quads", None, "quads", "quads"),
    ("quads", "quads", "quads", "quads"),
    ("modelopt", "quads", "quads", "modelopt"),       # the override trap: quads must win
    ("modelopt_file", "quads", "quads", "modelopt"),  # ModelOpt's hf_quant_config.json form
    ("quads_file", "quads", "quads", "quads"),        # the export's hf_quant_config.json alone
])
def test_model_config_chooses_quads(sglang_runtime, checkpoints, kind, flag,
                                    want_method, want_source):
    from sglang_ext.config import QuadsConfig

    method, qc = _model_config(checkpoints[kind], flag)
    assert method == want_method
    assert isinstance(qc, QuadsConfig) and qc.rollout.source == want_source
    # the exporter quantizes the routed experts only: attention, router and lm_head stay BF16
    for prefix in ("lm_head", "model.layers.0.mlp.gate", "model.layers.0.self_attn.qkv_proj"):
        assert qc.is_excluded(prefix), prefix
    assert not qc.is_layer_excluded("model.layers.0.mlp.experts")
    if want_source == "modelopt":
        assert (qc.rollout.precision, qc.rollout.activation_scaling) == ("w4a4", "static")
    else:
        assert qc.rollout.precision == "w4a4_rac" and qc.rollout.rac_channels == 16


def test_modelopt_checkpoint_without_flag_stays_modelopt(sglang_runtime, checkpoints):
    method, qc = _model_config(checkpoints["modelopt"], None)
    assert method == "modelopt_fp4" and type(qc).__name__ == "ModelOptFp4Config"


def test_without_quads_first_the_modelopt_override_wins(sglang_runtime, checkpoints):
    """The trap the plugin's ordering avoids: quads registered last loses to modelopt_fp4."""
    from sglang.srt.layers.quantization import QUANTIZATION_METHODS

    from sglang_ext.plugin import register

    quads = QUANTIZATION_METHODS.pop("quads")
    QUANTIZATION_METHODS["quads"] = quads
    try:
        assert _model_config(checkpoints["modelopt"], "quads")[0] == "modelopt_fp4"
    finally:
        register()
    assert _model_config(checkpoints["modelopt"], "quads")[0] == "quads"
