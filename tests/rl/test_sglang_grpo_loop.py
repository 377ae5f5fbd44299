"""The GRPO job's steps with SGLang rollouts (what `--sglang-launch` runs once its server is healthy), on CPU.

The server is the wire-format one of test_sglang_engine (SGLang cannot serve on CPU): every step the trainer
syncs its calibrated NVFP4 weights as a quads server of tp_size 1 takes them, generates with SGLang's
routed-experts capture on, and replays those routes in Megatron's router. What runs on the GPU with a real
server (tools/gpu_session.sh sglang-grpo) is this loop; here its plumbing is checked end to end.
"""

import pytest

from test_sglang_engine import _Server, trainer_against  # noqa: E402 (this directory is on sys.path under pytest)
from tiny_flags import TINY

pytest.importorskip("sglang", reason="SGLang is not installed (the wire format's bucket class)")

LAYERS, TOPK, EXPERTS = 2, 2, 4  # the tiny preset


def test_grpo_steps_with_sglang_rollouts_and_routing_replay(tmp_path):
    server = _Server(routes=(LAYERS, TOPK), num_experts=EXPERTS, quantization="quads")
    steps = 2
    with trainer_against(server, TINY + ["--tensorboard-dir", str(tmp_path / "tb"), "--rollout-engine", "sglang",
                                         "--sglang-url", server.url, "--use-rollout-routing-replay",
                                         "--train-iters", str(steps), "--eval-interval", "100"]) as trainer:
        summary = trainer.run()
    paths = server.paths()
    # the first sync before any rollout, then one per optimizer step; each bracketed
    assert paths.count("/begin_weight_update") == paths.count("/end_weight_update") >= steps + 1
    assert paths.index("/end_weight_update") < paths.index("/generate")
    generated = [b for p, b in server.calls if p == "/generate"]
    assert generated and all(b["return_routed_experts"] for b in generated)
    # each sync carried whole-layer experts and the calibration's RAC channels, every tensor on one device
    names = {n for bucket in server.received for (payload,) in [bucket] for n, _ in payload}
    assert "model.layers.0.mlp.experts.w13_weight" in names
    assert any(n.endswith("input_comp_index") for n in names)
    assert summary["steps"] == steps and summary["rollout_routing_replay"] is True
    # the server's random routes against the trainer's own: replayed, and their disagreement measured
    assert 0.0 < summary["mean_routing_disagreement"] <= 1.0
