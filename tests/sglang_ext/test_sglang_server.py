"""SGLang's real server with `--quantization quads`: it serves exported checkpoints and takes RL weight updates.

The reference is the local engine (transformers' Qwen3-MoE with our NVFP4 modules) on the same HF weights and
plan: a different attention, sampler and scheduler around the same kernels. The engines round differently
(attention kernels, bf16 order, an activation's E2M1 code flipped by an ulp), so greedy paths may part at
near-ties: the check is on log-probs up to and including each first divergence. An
update must switch the server to the new weights' outputs, and syncing the old weights back must give the
first outputs again bit for bit (same server, same CUDA graphs, no re-capture).

Needs a CUDA GPU and SGLang (tools/gpu_session.sh sglang installs the wheel set of tools/sglang_wheelhouse.sh).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("sglang", reason="SGLang is not installed")

CONFIG = dict(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8,
              num_experts_per_tok=2, max_position_embeddings=512, norm_topk_prob=True, tie_word_embeddings=False,
              decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6)
CALIB = ["--calib-size", "8", "--calib-seq-len", "64", "--seed", "0", "--rac-channels", "16"]
PROMPTS = [list(range(3 + i, 3 + i + 12)) for i in range(8)]
NEW_TOKENS = 16


def _save_hf(path, seed):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**CONFIG))
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def _export(hf, out, precision):
    from quads_megatron.convert import rollout_export

    rollout_export.main(["--load-dir", str(hf), "--save-dir", str(out), "--rollout-precision", precision,
                         *CALIB, "--device", "cuda", "--force", "--no-progress"])
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang_server")
    hf1, hf2 = _save_hf(root / "hf1", 1), _save_hf(root / "hf2", 2)
    return {"hf1": hf1, "hf2": hf2, "w4a4_rac": _export(hf1, root / "rac", "w4a4_rac"),
            "w4a4": _export(hf1, root / "w4a4", "w4a4"), "root": root}


def _server(ckpt, log):
    from quads_megatron.rl.engines.sglang_launch import SLIM_IMAGE_ARGS, SLIM_IMAGE_ENV, launch_server

    os.environ.update(SLIM_IMAGE_ENV)
    return launch_server(ckpt, 30123, [*SLIM_IMAGE_ARGS, "--skip-tokenizer-init", "--mem-fraction-static", "0.3",
                                       "--cuda-graph-max-bs-decode", "8", "--disable-radix-cache"], log)


def _local(hf, precision):
    from safetensors.torch import load_file
    from transformers import Qwen3MoeConfig

    from quads_megatron.models import qwen3_moe
    from quads_megatron.plan import QuantPlan
    from quads_megatron.recipe import QuadsRecipe
    from quads_megatron.rl.engines.local import LocalEngine
    from quads_megatron.vocab import parse_precision

    cfg = json.loads((hf / "config.json").read_text())
    plan = QuantPlan.resolve(QuadsRecipe(rollout_precision=parse_precision(precision), rac_channels=16),
                             qwen3_moe.dims_from_hf_config(cfg))
    engine = LocalEngine(Qwen3MoeConfig(**CONFIG), plan, max_seq_len=64, device="cuda")
    engine.update_weights(load_file(str(hf / "model.safetensors"), device="cuda").items())
    return engine, plan


def _greedy(engine):
    from quads_megatron.rl.engines.base import SamplingParams

    return engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS), seed=0)


def _close(a, b, median_tol=0.02, max_tol=0.25):
    """The engines agree up to rounding: over each sequence's tokens up to and including its first divergence
    (greedy paths part only where the top two tokens nearly tie), log-probs differ by a median of at most
    median_tol and never more than max_tol nats; a wrong weight, scale or kernel gives O(1) differences."""
    diffs = []
    for x, y in zip(a, b):
        n = next((i for i, (p, q) in enumerate(zip(x.response_ids, y.response_ids)) if p != q), NEW_TOKENS - 1)
        diffs += [abs(p - q) for p, q in zip(x.logprobs[: n + 1], y.logprobs[: n + 1])]
    diffs.sort()
    identical = sum(x.response_ids == y.response_ids for x, y in zip(a, b))
    summary = f"{identical}/{len(a)} identical, median {diffs[len(diffs) // 2]:.3g}, max {diffs[-1]:.3g}"
    print(summary)
    assert diffs[len(diffs) // 2] <= median_tol and diffs[-1] <= max_tol, summary


def test_rac_server_serves_what_the_local_engine_computes(ckpts):
    from quads_megatron.convert.calibration import random_prompts
    from quads_megatron.rl.engines.sglang_http import SGLangEngine

    from transformers import Qwen3MoeConfig

    url, proc = _server(ckpts["w4a4_rac"], ckpts["root"] / "rac.log")
    try:
        served = _greedy(SGLangEngine([url], 64, hf_config=Qwen3MoeConfig(**CONFIG)))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    local, _ = _local(ckpts["hf1"], "w4a4_rac")
    local.calibrate([p.tolist() for p in random_prompts(CONFIG["vocab_size"], num_samples=8, seq_len=64, seed=0)])
    mine = _greedy(local)
    _close(served, mine)
    _same_routes(served, mine)


def _same_routes(a, b, min_share=0.95):
    """SGLang's routed-experts capture (our MoE method takes its top-k from SGLang's TopK layer) returns
    each fed token's top-k per layer as the local engine records it: over the tokens both engines were fed
    (prompt and response up to the first divergence), the top-k sets agree but for near-ties; a capture in
    the wrong order or layout agrees by chance only (top-2 of 8: 1 in 28)."""
    same = total = 0
    for x, y in zip(a, b):
        for r in (x, y):
            assert r.routed_experts is not None and r.routed_experts.shape == (
                len(r.prompt_ids) + len(r.response_ids) - 1, CONFIG["num_hidden_layers"], CONFIG["num_experts_per_tok"])
        shorter = min(len(x.response_ids), len(y.response_ids))
        n = next((i for i, (p, q) in enumerate(zip(x.response_ids, y.response_ids)) if p != q), shorter - 1)
        rows = len(x.prompt_ids) + n  # positions fed identically: the prompt and the agreeing response tokens
        eq = (x.routed_experts[:rows].sort(-1).values == y.routed_experts[:rows].cpu().sort(-1).values).all(-1)
        same, total = same + int(eq.sum()), total + eq.numel()
    print(f"routes: {same}/{total} (token, layer) top-k sets agree")
    assert same >= min_share * total, f"{same}/{total} top-k sets agree"


def _layer_stream(hf):
    """The HF checkpoint as the trainer's layer stream: each layer's experts one ExpertsLayer of [E, N, K] stacks."""
    from safetensors.torch import load_file

    from quads_megatron.plan import ExpertsLayer

    tensors = load_file(str(hf / "model.safetensors"), device="cuda")
    E = CONFIG["num_experts"]
    for layer in range(CONFIG["num_hidden_layers"]):
        pre = f"model.layers.{layer}.mlp.experts"
        fc1 = torch.stack([torch.cat([tensors.pop(f"{pre}.{e}.{p}.weight") for p in ("gate_proj", "up_proj")])
                           for e in range(E)])
        yield ExpertsLayer(layer, fc1, torch.stack([tensors.pop(f"{pre}.{e}.down_proj.weight") for e in range(E)]))
    yield from tensors.items()


def test_weight_updates_switch_the_running_server_to_the_new_weights(ckpts):
    from safetensors.torch import load_file
    from transformers import Qwen3MoeConfig

    from quads_megatron.plan import quantize_named_params
    from quads_megatron.rl.engines.sglang_http import SGLangEngine

    local1, plan = _local(ckpts["hf1"], "w4a4")
    local2, _ = _local(ckpts["hf2"], "w4a4")
    url, proc = _server(ckpts["w4a4"], ckpts["root"] / "w4a4.log")
    try:
        before = _greedy(SGLangEngine([url], 64))
        _close(before, _greedy(local1))
        for mode, hf, want in (("tensor", ckpts["hf2"], local2), ("disk", ckpts["hf1"], None)):
            named = list(quantize_named_params(load_file(str(hf / "model.safetensors"), device="cuda").items(), plan))
            engine = SGLangEngine([url], 64, weight_sync=mode, sync_dir=str(ckpts["root"] / "sync"),
                                  hf_config=Qwen3MoeConfig(**CONFIG))  # what the GRPO job's disk sync writes
            engine.update_weights(named)
            after = _greedy(engine)
            if want is not None:
                assert [r.response_ids for r in after] != [r.response_ids for r in before], "update had no effect"
                _close(after, _greedy(want))
            else:  # the first weights again: the first outputs, bit for bit
                assert [r.response_ids for r in after] == [r.response_ids for r in before]
                assert [r.logprobs for r in after] == [r.logprobs for r in before]
            if mode == "tensor":
                per_expert = after
        # the GRPO job's layer stream to a tp_size 1 quads server: whole-layer FusedMoE tensors, the same outputs
        engine = SGLangEngine([url], 64, hf_config=Qwen3MoeConfig(**CONFIG), stacked_experts=True)
        assert engine.sends_stacked
        engine.update_weights(list(quantize_named_params(_layer_stream(ckpts["hf2"]), plan, keep_layers=True)))
        stacked = _greedy(engine)
        assert [r.response_ids for r in stacked] == [r.response_ids for r in per_expert]
        assert [r.logprobs for r in stacked] == [r.logprobs for r in per_expert]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
