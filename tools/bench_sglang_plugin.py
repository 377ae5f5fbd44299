"""Benchmark the `--quantization quads` layers inside SGLang: forward, CUDA-graph replay, RL weight update.

Builds SGLang's QKVParallelLinear and FusedMoE with the quads methods at Qwen3-30B-A3B shapes
(or --tiny ones), loads random NVFP4 checkpoint tensors through SGLang's loaders and prints a
table: eager forward and CUDA-graph replay per layer (decode batch; on a GPU also SGLang's own
BF16 and FP8 FusedMoE at the same shapes and routing, the server's baselines), one RL weight update of
the layer (restore -> load -> process, SGLang's begin/end_weight_update helpers, tensors
already on the device), and whether the graph captured before the update replays the new
weights (equal to an eager forward). Correctness against the reference is the tests' job.

    python tools/bench_sglang_plugin.py            # H100/H200, needs SGLang importable
    python tools/bench_sglang_plugin.py --tiny     # CPU smoke run (torch reference kernels)
    python tools/bench_sglang_plugin.py --update-only   # the MoE update alone: per expert vs whole layer

The MoE update runs twice: per expert and shard (SGLang's expert branch, 9+ loader calls per expert) and
"stacked", one whole-layer tensor per FusedMoE parameter (`sglang_ext.stacked_load`, what the GRPO tensor
sync sends a tp_size 1 server).
"""

from __future__ import annotations

import argparse
import functools
import socket
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "sglang_ext")]

from sglang_fixtures import comp_index, input_scale, nvfp4_gate_up, nvfp4_linear  # noqa: E402

SHAPES = {  # hidden, heads, kv heads, head dim, experts, moe ffn, top-k
    "qwen3-30b-a3b": dict(h=2048, heads=32, kv=4, hd=128, e=128, f=768, topk=8),
    "tiny": dict(h=64, heads=4, kv=2, hd=16, e=4, f=32, topk=2),
}


def init_sglang() -> None:
    """load_plugins + a 1-rank gloo world, as the scheduler does at start-up."""
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    load_plugins()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                    distributed_init_method=f"tcp://127.0.0.1:{port}")
    reset_context()
    publish(ServerArgs(model_path="dummy"), role="test", ranks=SpawnRanks(world_rank=0))
    get_parallel().override_permanently(world_group=ps._WORLD)
    ps.initialize_model_parallel(backend="gloo")


def timed(fn, device, iters: int) -> float:
    """Median ms per call after a warm-up (the benchmarks' one timer: CUDA events per call)."""
    from quads_megatron.apps.study.timing import time_ms

    return time_ms(fn, device=device, iters=iters, warmup=1, mode="events")


def update(model, load, device) -> None:
    from sglang.srt.model_loader.loader import DefaultModelLoader

    DefaultModelLoader.restore_weights_before_loading(model, device)
    load()
    DefaultModelLoader.postprocess_weights(model, device)


def graph_of(fn, device):
    """(replay callable, static output): a CUDA graph on GPU, the eager call elsewhere."""
    if device.type != "cuda":
        return fn, None
    from quads_megatron.apps.study.timing import capture_graph

    g, out = capture_graph(fn)
    return g.replay, out


def bench_qkv(sh, cfg, device, tokens, iters):
    from sglang.srt.layers.linear import QKVParallelLinear

    with device:
        layer = QKVParallelLinear(sh["h"], sh["hd"], sh["heads"], sh["kv"], bias=False,
                                  params_dtype=torch.bfloat16, quant_config=cfg, prefix="qkv_proj")
    model = torch.nn.ModuleDict({"qkv": layer})
    widths = {"q": sh["heads"] * sh["hd"], "k": sh["kv"] * sh["hd"], "v": sh["kv"] * sh["hd"]}

    def tensors(seed):
        """(param, tensor, shard) calls of one checkpoint version, already on the device."""
        calls = []
        for sid, n in widths.items():
            t = {**nvfp4_linear(n, sh["h"], seed), "input_scale": input_scale(seed),
                 "input_comp_index": comp_index(sh["h"], cfg.rollout.rac_channels or 16, seed)}
            calls += [(getattr(layer, name), v.to(device), (sid,)) for name, v in t.items()
                      if hasattr(layer, name)]
        return calls

    x = torch.randn(tokens, sh["h"], device=device, dtype=torch.bfloat16)
    return run(model, lambda: layer(x)[0], tensors, device, iters)


def stack_layer(ck: dict, e: int) -> dict:
    """Per-expert HF tensors (`experts.{e}.{proj}.{key}`) as the FusedMoE parameters they fill, whole
    (`w13_weight` [E, 2F, H/2]: gate rows then up rows, `w13_weight_scale_2` [E, 2], ...)."""
    out = {}
    for which, projs in (("w13", ("gate_proj", "up_proj")), ("w2", ("down_proj",))):
        for key in ("weight", "weight_scale", "weight_scale_2", "input_scale", "input_comp_index"):
            per = [[ck[f"experts.{x}.{p}.{key}"] for p in projs] for x in range(e)]
            if key in ("weight", "weight_scale"):
                t = torch.stack([torch.cat(ts) for ts in per])
            else:
                t = torch.stack([torch.stack([v.reshape(-1) for v in ts]) for ts in per])  # [E, projs, 1 or k]
                t = t.reshape(e, len(projs), -1) if key == "input_comp_index" else t.reshape(e, len(projs))
                t = t if which == "w13" else t.reshape(e, *t.shape[2:])
            out[f"{which}_{key}"] = t
    return out


def decode_inputs(sh, device, tokens):
    """(hidden states, SGLang top-k output) of one decode batch, seeded: every MoE row sees the same routing."""
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    gen = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(tokens, sh["h"], device=device, dtype=torch.bfloat16, generator=gen)
    logits = torch.randn(tokens, sh["e"], device=device, generator=gen)
    w, ids = torch.topk(torch.softmax(logits, -1), sh["topk"], dim=-1)
    return x, StandardTopKOutput(w / w.sum(-1, keepdim=True), ids.to(torch.int32), logits)


def bench_moe(sh, cfg, device, tokens, iters, stacked=False):
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE

    e, h, f = sh["e"], sh["h"], sh["f"]
    with device:
        layer = FusedMoE(num_experts=e, hidden_size=h, intermediate_size=f, layer_id=0,
                         top_k=sh["topk"], params_dtype=torch.bfloat16, quant_config=cfg,
                         prefix="experts")
    model = torch.nn.ModuleDict({"experts": layer})
    mapping = FusedMoE.make_expert_params_mapping("gate_proj", "down_proj", "up_proj", e)
    params = dict(layer.named_parameters(prefix="experts"))
    k = cfg.rollout.rac_channels
    def tensors(seed):
        """(param, tensor, loader args) calls of one checkpoint version, already on the device: per expert and
        shard (SGLang's expert branch), or with stacked one whole-layer tensor per parameter (two arguments)."""
        fc1, calls, ck = comp_index(h, k or 16, seed), [], {}
        for ex in range(e):
            gate, up = nvfp4_gate_up(f, h, seed + ex)
            for proj, t in (("gate_proj", gate), ("up_proj", up),
                            ("down_proj", nvfp4_linear(h, f, seed + e + ex))):
                ck.update({f"experts.{ex}.{proj}.{key}": v for key, v in t.items()})
                ck[f"experts.{ex}.{proj}.input_scale"] = input_scale(seed)
                ck[f"experts.{ex}.{proj}.input_comp_index"] = (
                    comp_index(f, k or 16, seed + ex) if proj == "down_proj" else fc1)
        if stacked:
            return [(params[f"experts.{n}"], t.to(device), ()) for n, t in stack_layer(ck, e).items()
                    if f"experts.{n}" in params]
        for name, t in ck.items():
            for param_name, weight_name, expert_id, shard_id in mapping:
                if weight_name in name:
                    target = name.replace(weight_name, param_name)
                    if target in params:
                        calls.append((params[target], t.to(device), (target, shard_id, expert_id)))
                    break
        return calls

    x, topk = decode_inputs(sh, device, tokens)
    return run(model, lambda: layer(x, topk), tensors, device, iters)


def bench_moe_sglang(sh, device, tokens, iters, fp8: bool):
    """SGLang's own FusedMoE at the same shapes and routing: BF16 (no quant_config) or FP8 (`Fp8Config()`, what
    `--quantization fp8` does to a BF16 checkpoint: e4m3 weights quantized at load, dynamic activations) ->
    graph ms (the baselines of the quads rows, same run)."""
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang.srt.model_loader.loader import DefaultModelLoader

    e, h, f = sh["e"], sh["h"], sh["f"]
    with device:
        layer = FusedMoE(num_experts=e, hidden_size=h, intermediate_size=f, layer_id=0, top_k=sh["topk"],
                         params_dtype=torch.bfloat16, quant_config=Fp8Config() if fp8 else None, prefix="experts")
    model = torch.nn.ModuleDict({"experts": layer})
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            if p.is_floating_point() and p.dim() == 3:  # the expert weights; scales keep their initial ones
                p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32) * 0.02)
    DefaultModelLoader.postprocess_weights(model, device)
    x, topk = decode_inputs(sh, device, tokens)
    replay, out = graph_of(lambda: layer(x, topk), device)
    return timed(replay, device, iters)


def run(model, fwd, tensors, device, iters):
    """(eager ms, graph ms, update ms, replay after update == eager); iters 0: the update only, as
    (load ms, process ms, update ms, loader calls)."""
    def load(calls):
        for p, t, args in calls:
            p.weight_loader(p, t, *args)

    first, second = tensors(1), tensors(2)
    update(model, lambda: load(first), device)
    if not iters:  # the update alone, its two halves: the loader calls, then process_weights_after_loading
        import time

        from sglang.srt.model_loader.loader import DefaultModelLoader

        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        DefaultModelLoader.restore_weights_before_loading(model, device)
        sync()
        t0 = time.perf_counter()
        load(second)
        sync()
        t1 = time.perf_counter()
        DefaultModelLoader.postprocess_weights(model, device)
        sync()
        t2 = time.perf_counter()
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t2 - t0) * 1e3, len(second)
    eager = timed(fwd, device, iters)
    replay, out = graph_of(fwd, device)
    graph = timed(replay, device, iters) if out is not None else float("nan")
    from quads_megatron.apps.study.timing import time_ms

    upd = time_ms(lambda: update(model, lambda: load(second), device), device=device, iters=1, warmup=0, mode="wall")
    ok = True
    if out is not None:
        replay()
        ok = torch.equal(out, fwd())
    return eager, graph, upd, ok


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    p.add_argument("--tokens", type=int, default=16, help="decode batch (tokens per forward)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--mode", default="w4a4_rac", choices=("w4a4", "w4a4_rac", "w4a16"))
    p.add_argument("--update-only", action="store_true",
                   help="time the MoE layer's weight update only (per expert vs whole-layer tensors; a CPU run)")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    init_sglang()
    from quads_megatron.plan.rollout_schema import RolloutQuantConfig
    from sglang_ext.config import QuadsConfig

    sh = SHAPES["tiny" if args.tiny else "qwen3-30b-a3b"]
    k = 16 if args.tiny else 64
    cfg = QuadsConfig(RolloutQuantConfig(precision=args.mode, activation_scaling="per_token",
                                    rac_channels=k if args.mode == "w4a4_rac" else 0))
    print(f"device {device}, mode {args.mode}, {args.tokens} tokens, shapes {sh}")
    rows = [("experts", bench_moe),
            ("experts stacked", functools.partial(bench_moe, stacked=True))]  # one call per layer parameter
    rows = rows if args.update_only else [("qkv_proj", bench_qkv)] + rows
    if args.update_only:
        print(f"{'layer':<16} {'load ms':>9} {'process ms':>11} {'update ms':>10} {'loader calls':>13}")
        for name, fn in rows:
            load_ms, process_ms, upd, calls = fn(sh, cfg, device, args.tokens, 0)
            print(f"{name:<16} {load_ms:>9.1f} {process_ms:>11.1f} {upd:>10.1f} {calls:>13}")
        return
    print(f"{'layer':<16} {'eager ms':>9} {'graph ms':>9} {'update ms':>10}  replay after update")
    for name, fn in rows:
        eager, graph, upd, ok = fn(sh, cfg, device, args.tokens, args.iters)
        print(f"{name:<16} {eager:>9.3f} {graph:>9.3f} {upd:>10.1f}  "
              f"{'ok' if ok else 'STALE'}{'' if device.type == 'cuda' else ' (no graph on CPU)'}")
    if device.type == "cuda":  # SGLang's own MoE paths at the same shapes: the baselines the server runs
        for name, fp8 in (("experts SGLang bf16", False), ("experts SGLang fp8", True)):
            print(f"{name:<16} {'':>9} {bench_moe_sglang(sh, device, args.tokens, args.iters, fp8):>9.3f}")


if __name__ == "__main__":
    main()
