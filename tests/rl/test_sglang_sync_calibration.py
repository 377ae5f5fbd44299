"""A live weight sync to SGLang carries the plan's calibration: the input scales and RAC channels a server receives
are bit for bit those of the local engine after the same sync (issue 23: one calibration on the whole rollout side).

The GRPO trainer syncs its tiny model to a minimal server speaking SGLang's wire format (the one of
test_sglang_engine); the reference is a LocalEngine loaded with the trainer's weights and calibrated on the
trainer's calibration prompts.
"""

import pytest
import torch

from test_sglang_engine import _Server, trainer_against  # noqa: E402 (this directory is on sys.path under pytest)
from tiny_flags import TINY

pytest.importorskip("sglang", reason="SGLang is not installed (the wire format's bucket class)")


def _per_expert(received: dict) -> dict:
    """Whole-layer FusedMoE tensors (a quads server of tp_size 1 receives those) spelled out per expert."""
    out = {}
    for name, t in received.items():
        prefix, _, param = name.rpartition(".")
        which, _, key = param.partition("_")
        if not prefix.endswith("mlp.experts") or which not in ("w13", "w2"):
            out[name] = t
            continue
        projs = ("gate_proj", "up_proj") if which == "w13" else ("down_proj",)
        for e in range(t.shape[0]):
            parts = t[e].chunk(2) if which == "w13" and key in ("weight", "weight_scale") else \
                (t[e].unbind(0) if which == "w13" else [t[e]])
            for proj, v in zip(projs, parts):
                out[f"{prefix}.{e}.{proj}.{key}"] = v
    return out


@pytest.mark.parametrize("scaling,quantization", [("per_token", None), ("static", None), ("static", "quads")])
def test_sglang_sync_sends_the_local_engines_calibration(tmp_path, scaling, quantization):
    from quads_megatron.plan import quantize_named_params
    from quads_megatron.rl.engines.local import LocalEngine

    server = _Server(quantization=quantization)
    with trainer_against(server, TINY + ["--tensorboard-dir", str(tmp_path / "tb"), "--rollout-engine", "sglang",
                                         "--sglang-url", server.url, "--rollout-precision", "w4a4_rac",
                                         "--rac-channels", "16", "--activation-scaling", scaling]) as trainer:
        trainer.sync_weights()
        received = {n: t for bucket in server.received for (payload,) in [bucket] for n, t in payload}
        whole = [n for n in received if ".experts.w" in n]
        # a quads server of tp_size 1 takes each layer's experts whole (the job's default), any other per expert
        assert bool(whole) == (quantization == "quads"), whole[:4]
        received = _per_expert(received)
        local = LocalEngine(trainer.policy.hf_config(), trainer.policy.plan, max_seq_len=32, device="cpu",
                            dtype=torch.float32)
        local.update_weights(trainer.policy.hf_weights())
        local.calibrate(trainer.calibration_prompts())
        sent_weights = dict(quantize_named_params(trainer.policy.hf_weights(), trainer.policy.plan))
    want = dict(local.rollout.activation_tensors())
    plan = trainer.policy.plan
    quantized = [t for t in plan if t.quantized]
    assert quantized and set(want) == {f"{t.module}.{s}" for t in quantized for s in ("input_scale", "input_comp_index")}
    for name, t in want.items():
        assert torch.equal(received[name], t), name
    experts = local.nvfp4_modules["model.layers.0.mlp.experts"]
    assert torch.equal(received["model.layers.0.mlp.experts.2.down_proj.input_comp_index"], experts.w2_comp_index[2])
    assert received["model.layers.0.mlp.experts.0.gate_proj.weight"].dtype == torch.uint8   # NVFP4 sent as before
    # every weight is what the exporter's quantizer makes of the trainer's weights, bit for bit
    assert set(received) == set(sent_weights) | set(want)
    for name, t in sent_weights.items():
        assert received[name].dtype == t.dtype and torch.equal(received[name].reshape(-1).view(torch.uint8),
                                                               t.reshape(-1).view(torch.uint8)), name
