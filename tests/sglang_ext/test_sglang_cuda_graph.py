"""GPU only: CUDA graphs captured over quads layers stay valid across RL weight updates.

SGLang's model runner captures decode in CUDA graphs and `update_weights_from_tensor` does not
recapture them, so after restore -> load -> process a replay must compute with the new weights.
This checks that with the Triton kernels on CUDA, for a merged linear and a fused-MoE layer.
"""

from __future__ import annotations

import pytest
import torch

from sglang_fixtures import comp_index, input_scale, nvfp4_gate_up, nvfp4_linear
from quads_megatron.plan.rollout_schema import RolloutQuantConfig

pytest.importorskip("sglang", reason="SGLang is not installed")
pytestmark = pytest.mark.gpu


def _config():
    from sglang_ext.config import QuadsConfig

    return QuadsConfig(RolloutQuantConfig(precision="w4a4_rac", activation_scaling="per_token",
                                     rac_channels=16))


def _capture(fn):
    """(graph, static output) of fn() after a warm-up on a side stream."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def _update(model, load):
    """One RL weight update the way SGLang's begin/end_weight_update runs it."""
    from sglang.srt.model_loader.loader import DefaultModelLoader

    DefaultModelLoader.restore_weights_before_loading(model, torch.device("cuda"))
    load()
    DefaultModelLoader.postprocess_weights(model, torch.device("cuda"))


def test_linear_graph_replays_updated_weights(sglang_runtime):
    from sglang.srt.layers.linear import QKVParallelLinear

    with torch.device("cuda"):
        layer = QKVParallelLinear(256, 64, 4, 2, bias=False, params_dtype=torch.bfloat16,
                                  quant_config=_config(), prefix="model.layers.0.self_attn.qkv_proj")
    model = torch.nn.ModuleDict({"qkv": layer})
    widths = {"q": 256, "k": 128, "v": 128}

    def load(seed):
        for i, (sid, n) in enumerate(widths.items()):
            t = {**nvfp4_linear(n, 256, seed + i), "input_scale": input_scale(seed),
                 "input_comp_index": comp_index(256, 16, seed + i)}
            for name, v in t.items():
                p = getattr(layer, name)
                p.weight_loader(p, v.cuda(), sid)

    _update(model, lambda: load(1))
    x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
    graph, out = _capture(lambda: layer(x)[0])
    for seed in (20, 40, 1):
        _update(model, lambda: load(seed))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, layer(x)[0], rtol=0, atol=0)


def test_fused_moe_graph_replays_updated_weights(sglang_runtime):
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    e, h, f = 8, 256, 128
    with torch.device("cuda"):
        layer = FusedMoE(num_experts=e, hidden_size=h, intermediate_size=f, layer_id=0, top_k=2,
                         params_dtype=torch.bfloat16, quant_config=_config(),
                         prefix="model.layers.0.mlp.experts")
    model = torch.nn.ModuleDict({"experts": layer})
    mapping = FusedMoE.make_expert_params_mapping("gate_proj", "down_proj", "up_proj", e)
    params = dict(layer.named_parameters(prefix="experts"))

    def load(seed):
        fc1 = comp_index(h, 16, seed)
        for ex in range(e):
            gate, up = nvfp4_gate_up(f, h, seed + ex)
            ck = {}
            for proj, t in (("gate_proj", gate), ("up_proj", up),
                            ("down_proj", nvfp4_linear(h, f, seed + 100 + ex))):
                ck.update({f"experts.{ex}.{proj}.{k}": v for k, v in t.items()})
                ck[f"experts.{ex}.{proj}.input_scale"] = input_scale(seed)
                ck[f"experts.{ex}.{proj}.input_comp_index"] = (
                    fc1 if proj != "down_proj" else comp_index(f, 16, seed + ex))
            for name, t in ck.items():
                for param_name, weight_name, expert_id, shard_id in mapping:
                    if weight_name in name:
                        target = name.replace(weight_name, param_name)
                        p = params[target]
                        p.weight_loader(p, t.cuda(), target, shard_id=shard_id, expert_id=expert_id)
                        break

    _update(model, lambda: load(1))
    x = torch.randn(16, h, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(16, e, device="cuda")
    w, ids = torch.topk(torch.softmax(logits, -1), 2, dim=-1)
    topk = StandardTopKOutput(w / w.sum(-1, keepdim=True), ids.to(torch.int32), logits)
    graph, out = _capture(lambda: layer(x, topk))
    for seed in (30, 1):
        _update(model, lambda: load(seed))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, layer(x, topk), rtol=0, atol=0)
