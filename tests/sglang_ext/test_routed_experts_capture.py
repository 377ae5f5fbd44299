"""SGLang's routed-experts capture (R3) with the quads FusedMoE method: the ids SGLang's own TopK layer selects
are what its real RoutedExpertsCapturer records per layer, and what QuadsMoEMethod computes with.

The capturer is SGLang's class (``state_capturer.routed_experts.RoutedExpertsCapturer``), installed the way
the model runner installs it; the reference ids are torch.topk of the softmax of the router logits.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_fixtures import load_experts, moe_checkpoint

pytest.importorskip("sglang", reason="SGLang is not installed")

E, H, F, TOPK, LAYERS, TOKENS = 4, 64, 32, 2, 2, 6


@pytest.fixture
def capturer(sglang_runtime, monkeypatch):
    from sglang.srt.mem_cache.pool_host.common import ALLOC_MEMORY_FUNCS
    from sglang.srt.runtime_context import get_schedule
    from sglang.srt.state_capturer.routed_experts import (RoutedExpertsCapturer, get_global_experts_capturer,
                                                          set_global_experts_capturer)

    # the host cache pins its buffer with cudaHostRegister, which needs a GPU: plain host memory here
    monkeypatch.setitem(ALLOC_MEMORY_FUNCS, "cpu", lambda dims, dtype, device, pin_memory, allocator, **kw:
                        torch.empty(dims, dtype=dtype, device=device))
    hf = SimpleNamespace(num_experts_per_tok=TOPK, num_hidden_layers=LAYERS)
    with get_schedule().override(chunked_prefill_size=64):  # what the server resolves at start-up
        cap = RoutedExpertsCapturer(SimpleNamespace(hf_text_config=hf), num_tokens=64, max_running_requests=8,
                                    num_fused_shared_experts=0, device="cpu")
    before = get_global_experts_capturer()
    set_global_experts_capturer(cap)
    yield cap
    set_global_experts_capturer(before)


def test_topk_layer_feeds_the_capturer_and_the_quads_moe_method(capturer):
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE
    from sglang.srt.layers.moe.topk import TopK

    from quads_megatron.plan.rollout_schema import RolloutQuantConfig
    from sglang_ext.config import QuadsConfig
    from sglang_ext.moe_method import QuadsMoEMethod

    cfg = QuadsConfig(RolloutQuantConfig(precision="w4a4", activation_scaling="per_token", rac_channels=0))
    ckpt = moe_checkpoint(E, H, F, 16, 5)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(TOKENS, H, generator=g).to(torch.bfloat16)
    used = {}
    for layer_id in range(LAYERS):
        logits = torch.randn(TOKENS, E, generator=g)
        topk = TopK(top_k=TOPK, layer_id=layer_id, renormalize=True)
        out = topk(x, logits)
        moe = FusedMoE(num_experts=E, hidden_size=H, intermediate_size=F, layer_id=layer_id, top_k=TOPK,
                       params_dtype=torch.bfloat16, quant_config=cfg, prefix=f"model.layers.{layer_id}.mlp.experts")
        assert isinstance(moe.quant_method, QuadsMoEMethod)
        load_experts(moe, ckpt, E)
        moe.quant_method.process_weights_after_loading(moe)
        y = moe(x, out)
        assert torch.isfinite(y.float()).all()
        used[layer_id] = out.topk_ids
        want = torch.topk(torch.softmax(logits, -1), TOPK, -1).indices.sort(-1).values
        assert torch.equal(out.topk_ids.long().sort(-1).values, want)
    buf = capturer.device_cache.buffer
    for layer_id, ids in used.items():
        assert torch.equal(buf[:TOKENS, layer_id].long(), ids.long())
