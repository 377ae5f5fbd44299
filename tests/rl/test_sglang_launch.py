"""--sglang-launch's first half: the live trainer exported as a QUADS NVFP4 rollout checkpoint SGLang can load."""

import json

import pytest

from quads_megatron.rl.arguments import parse_args
from quads_megatron.rl.engines.sglang_launch import export_rollout_checkpoint
from quads_megatron.rl.policy import MegatronPolicy
from quads_megatron.rl.tokenizer import build_char_tokenizer


@pytest.mark.parametrize("precision,flags", [("w4a4_rac", []), ("w4a4", ["--bf16"])])
def test_export_rollout_checkpoint(tiny_args, tmp_path, precision, flags):
    """The launched server serves the run's --rollout-precision (it used to always be w4a4_rac)."""
    args = parse_args(tiny_args("--rollout-precision", precision, *flags))
    policy = MegatronPolicy(args, 128)
    prompts = [f"sort:{i:03d}=" for i in range(8)]
    out = export_rollout_checkpoint(policy, build_char_tokenizer(), tmp_path / "sg", calib_prompts=prompts)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "quads"
    assert cfg["quantization_config"]["precision"] == precision
    assert cfg.get("num_experts", cfg.get("num_local_experts")) == policy.config.num_moe_experts and cfg["vocab_size"] == 128
    assert (out / "tokenizer.json").is_file() and cfg["eos_token_id"] == 1
    from safetensors import safe_open

    with safe_open(str(next(out.glob("*.safetensors"))), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.mlp.experts.0.gate_proj.weight_scale_2" in keys
    assert "model.embed_tokens.weight" in keys


def test_server_env_drops_what_torchrun_exports(tmp_path):
    """The server gets the environment torchrun started from, not its workers' launch variables (with them,
    torch < 2.14 makes the server's rendezvous a client of the torchrun agent's store: it hangs)."""
    import os
    import subprocess
    import sys

    from quads_megatron.rl.engines.sglang_launch import server_env

    script = tmp_path / "env.py"
    script.write_text("import json, os; print(json.dumps(dict(os.environ)))\n")
    base = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "CUDA_VISIBLE_DEVICES": "0", "LC_CTYPE": "C.UTF-8"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", str(script)],
                         env=base, capture_output=True, text=True, timeout=120, check=True)
    worker = json.loads(run.stdout.strip().splitlines()[-1])
    assert "TORCHELASTIC_USE_AGENT_STORE" in worker and "MASTER_PORT" in worker  # torchrun's, as the server saw
    assert server_env(worker) == base
