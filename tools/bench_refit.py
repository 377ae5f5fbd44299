"""Refit cost per RL step for a Qwen3-30B-A3B expert set, each next to its HBM floor, in one run.

  python tools/bench_refit.py                      # CUDA: 48 layers x 128 experts, hidden 2048, FFN 768
  python tools/bench_refit.py --device cpu --tiny  # smoke run (torch reference, 2 tiny layers)

Per layer, on the trainer's own code paths (expert weights as separate BF16 tensors, as Megatron's
SequentialMLP holds them; layers built one at a time so the whole model need not fit):
  (a) AQAT refresh:   ``ExpertsFakeQuant.refresh`` of fc1 and fc2 (one grouped launch each);
  (b) build NVFP4:    ``quantize_scale_groups`` over the layer's HF-named gate/up/down stream, into
                      new buffers (what the SGLang tensor sync sends);
  (c) build + load:   the same, written straight into a local engine's ``NVFP4Experts`` buffers (the
                      local engine's sync); the old path (per-expert quantize, then a copy per
                      tensor) is timed next to it on one layer.
  (b2) / (c2):        (b) / (c) on the layer stream (``plan.ExpertsLayer``: the layer's experts as one
                      item, ``iter_hf_weights(stacked_experts=True)``): two grouped launches per layer and
                      no per-expert Python; (b3) adds the per-expert ModelOpt views an SGLang sync sends.
Floors are bytes moved at the device-copy bandwidth measured in the same run: (a) reads and writes
BF16; (b)/(c) read BF16 and write 0.5625 B/parameter. A wire-size column compares sending BF16 to
an SGLang server (it quantizes) against sending NVFP4. CUDA-event timings, median of --iters.
"""

import argparse
import json

import torch


def _timer(device):
    """``run(fn, iters, warmup)`` -> median ms per call (the benchmarks' one timer, CUDA events per call)."""
    from quads_megatron.apps.study.timing import time_ms

    return lambda fn, iters, warmup: time_ms(fn, device=device, iters=iters, warmup=warmup, mode="events")


def _copy_bandwidth(device):
    """Device copy bandwidth in TB/s (read + write); NaN off a GPU."""
    from quads_megatron.apps.study.timing import copy_bandwidth

    return copy_bandwidth(device) / 1e12


def _layer(E, H, F, device, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    fc1 = [(torch.randn(2 * F, H, generator=g) * 0.02).to(device, torch.bfloat16) for _ in range(E)]
    fc2 = [(torch.randn(H, F, generator=g) * 0.02).to(device, torch.bfloat16) for _ in range(E)]
    return fc1, fc2


def _named(layer, fc1, fc2, F):
    """The HF-named stream the trainer's sync yields for one layer's experts."""
    pre = f"model.layers.{layer}.mlp.experts"
    for e, (w1, w2) in enumerate(zip(fc1, fc2)):
        yield f"{pre}.{e}.gate_proj.weight", w1[:F]
        yield f"{pre}.{e}.up_proj.weight", w1[F:]
        yield f"{pre}.{e}.down_proj.weight", w2


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="2 layers, 8 experts, hidden 128, FFN 64")
    p.add_argument("--num-layers", type=int, default=48)
    p.add_argument("--num-experts", type=int, default=128)
    p.add_argument("--hidden-size", type=int, default=2048)
    p.add_argument("--moe-ffn-hidden-size", type=int, default=768)
    p.add_argument("--iters", type=int, default=5, help="timed repeats per layer")
    p.add_argument("--json", default="")
    a = p.parse_args()
    if a.tiny:
        a.num_layers, a.num_experts, a.hidden_size, a.moe_ffn_hidden_size, a.iters = 2, 8, 128, 64, 2
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available (use --device cpu --tiny)")

    from quads_megatron import nvfp4
    from quads_megatron.models import qwen3_moe
    from quads_megatron.megatron.fake_quant import ExpertsFakeQuant
    from quads_megatron.plan import ExpertsLayer, QuantPlan, quantize_scale_groups
    from quads_megatron.plan.named_params import rollout_items
    from quads_megatron.recipe import QuadsRecipe
    from quads_megatron.rollout.modules import NVFP4Experts, load_quantized
    from quads_megatron.vocab import Precision

    L, E, H, F = a.num_layers, a.num_experts, a.hidden_size, a.moe_ffn_hidden_size
    dims = qwen3_moe.Dims(vocab_size=256, hidden_size=H, num_layers=L, num_heads=32, num_kv_heads=4,
                          head_dim=128 if not a.tiny else 16, num_experts=E, moe_ffn=F, tie_word_embeddings=False)
    plan = QuantPlan.resolve(QuadsRecipe(train_precision="w4a16", rollout_precision="w4a4"), dims)
    run = _timer(device)
    bw = _copy_bandwidth(device)
    params = 3 * E * H * F
    bytes_refresh = params * 4                # read + write BF16
    bytes_build = params * (2 + 0.5625)       # read BF16, write codes + E4M3 scales
    engine = NVFP4Experts(E, H, F, Precision.W4A4, device)

    def floor(nbytes):
        return nbytes / bw / 1e9 if bw == bw else float("nan")

    # correctness on layer 0 first: grouped results equal the per-tensor path
    fc1, fc2 = _layer(E, H, F, device, 0)
    caches = [ExpertsFakeQuant("fc1", fc1), ExpertsFakeQuant("fc2", fc2)]
    for c, ws in zip(caches, (fc1, fc2)):
        got = c.refresh()
        for e in (0, E // 2, E - 1):
            ref = nvfp4.fake_quantize(ws[e], check_finite=False)
            assert torch.equal(got[e].view(torch.int16), ref.view(torch.int16)), f"refresh != fake_quantize, expert {e}"
    groups = list(quantize_scale_groups(_named(0, fc1, fc2, F), plan))
    for names, tensors, qs in groups[:3] + groups[-3:]:
        ref = nvfp4.quantize_with_shared_scale(tensors) if len(tensors) > 1 else [nvfp4.quantize(tensors[0])]
        for n, q, r in zip(names, qs, ref):
            assert torch.equal(q.data, r.data) and torch.equal(q.global_scale, r.global_scale), n
    print("correctness: grouped refresh and build equal the per-tensor nvfp4 path")

    def refresh():
        for c in caches:
            c.refresh()

    def build():
        for _ in quantize_scale_groups(_named(layer, fc1, fc2, F), plan):
            pass

    def build_into_engine():
        def destination(lay, role, experts):
            return engine.grouped_buffers(role, experts)
        for _ in quantize_scale_groups(_named(layer, fc1, fc2, F), plan, destination=destination):
            pass

    def build_layer():
        for _ in quantize_scale_groups([ExpertsLayer(layer, fc1, fc2)], plan):
            pass

    def build_layer_views():  # what an SGLang sync hands to its flat buckets: per-expert ModelOpt names
        for item in quantize_scale_groups([ExpertsLayer(layer, fc1, fc2)], plan):
            for _ in rollout_items(item):
                pass

    def build_layer_into_engine():
        def destination(lay, role, experts):
            return engine.grouped_buffers(role, experts)
        for _ in quantize_scale_groups([ExpertsLayer(layer, fc1, fc2)], plan, destination=destination):
            pass

    # the layer stream's bytes equal the per-expert stream's, in the engine's own buffers
    ref = NVFP4Experts(E, H, F, Precision.W4A4, device)
    for _ in quantize_scale_groups(_named(0, fc1, fc2, F), plan,
                                   destination=lambda lay, role, ex, m=ref: m.grouped_buffers(role, ex)):
        pass
    ptr = engine.w13.data_ptr()
    layer = 0
    build_layer_into_engine()
    assert engine.w13.data_ptr() == ptr, "the layer stream rebound the engine's buffers"
    for n in ("w13", "w13_scale", "w13_scale_2", "w2", "w2_scale", "w2_scale_2"):
        assert torch.equal(getattr(engine, n).view(torch.uint8), getattr(ref, n).view(torch.uint8)), n
    del ref
    print("correctness: the layer stream writes the per-expert stream's bytes into the same buffers")

    modules = {"model.layers.0.mlp.experts": engine}

    def old_per_expert():  # before: one quantize per scale group, then a copy per tensor into the engine
        for names, tensors, _ in groups:
            qs = nvfp4.quantize_with_shared_scale(tensors) if len(tensors) > 1 else [nvfp4.quantize(tensors[0])]
            for n, t, q in zip(names, tensors, qs):
                load_quantized(modules, n, t, q)

    layer = 0
    old_ms = run(old_per_expert, max(1, a.iters // 2), 1)
    one = {"refresh": run(refresh, a.iters, 2), "build": run(build, a.iters, 2),
           "build_load": run(build_into_engine, a.iters, 2), "build_layer": run(build_layer, a.iters, 2),
           "build_layer_views": run(build_layer_views, a.iters, 2),
           "build_load_layer": run(build_layer_into_engine, a.iters, 2)}
    # a whole step: every layer in turn (two weight sets alternate, so no layer's data is in L2;
    # each layer keeps its own fake-quant cache and engine buffers, as in training)
    sets = [(fc1, fc2), _layer(E, H, F, device, 1)]
    layer_caches = [[ExpertsFakeQuant("fc1", sets[i % 2][0]), ExpertsFakeQuant("fc2", sets[i % 2][1])]
                    for i in range(L)]
    engines = [NVFP4Experts(E, H, F, Precision.W4A4, device) for _ in range(L)]

    def step_refresh():
        for cs in layer_caches:
            for c in cs:
                c.refresh()

    def step_build(into_engine, layers=False, views=False):
        def stream():
            for i in range(L):
                w1, w2 = sets[i % 2]
                if layers:
                    yield ExpertsLayer(i, w1, w2)
                else:
                    yield from _named(i, w1, w2, F)
        dest = (lambda lay, role, ex: engines[lay].grouped_buffers(role, ex)) if into_engine else None
        for item in quantize_scale_groups(stream(), plan, destination=dest):
            if views:
                for _ in rollout_items(item):
                    pass

    reps = max(1, a.iters // 2)
    steps = {"refresh": run(step_refresh, reps, 1),
             "build": run(lambda: step_build(False), reps, 1),
             "build_load": run(lambda: step_build(True), reps, 1),
             "build_layer": run(lambda: step_build(False, layers=True), reps, 1),
             "build_layer_views": run(lambda: step_build(False, layers=True, views=True), reps, 1),
             "build_load_layer": run(lambda: step_build(True, layers=True), reps, 1)}
    name = f"{L} layers x {E} experts, hidden {H}, FFN {F}, {device}" + (
        f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else "")
    print(f"Refit per RL step: {name}; device copy {bw:.2f} TB/s")
    print("| what | one layer ms | x floor | whole step ms (all layers) | step x floor | floor per layer ms |")
    print("|---|---|---|---|---|---|")
    out = {"layers": L, "experts": E, "hidden": H, "ffn": F, "copy_tb_s": bw, "old_per_expert_build_load_ms": old_ms}
    for key, what, nbytes in (("refresh", "(a) AQAT refresh (fc1 + fc2 fake-quant)", bytes_refresh),
                              ("build", "(b) build NVFP4 rollout weights, per-expert HF stream (old)", bytes_build),
                              ("build_load", "(c) build + load into the local engine in place, per-expert stream (old)",
                               bytes_build),
                              ("build_layer", "(b2) build NVFP4, layer stream (ExpertsLayer)", bytes_build),
                              ("build_layer_views", "(b3) (b2) + per-expert ModelOpt views (SGLang wire names)",
                               bytes_build),
                              ("build_load_layer", "(c2) build + load in place, layer stream", bytes_build)):
        fl = floor(nbytes)
        print(f"| {what} | {one[key]:.3f} | {one[key] / fl:.2f} | {steps[key]:.1f} | {steps[key] / (fl * L):.2f} "
              f"| {fl:.3f} |")
        out[key] = {"layer_ms": one[key], "step_ms": steps[key], "floor_layer_ms": fl,
                    "x_floor": one[key] / fl, "step_x_floor": steps[key] / (fl * L)}
    print(f"| old path: per-expert quantize + copy into the engine | {old_ms:.3f} | {old_ms / floor(bytes_build):.2f} "
          f"| {old_ms * L:.1f} (x{L}) | - | {floor(bytes_build):.3f} |")
    wire_bf16, wire_fp4 = params * 2 * L, params * 0.5625 * L + 4 * 2 * E * L
    print(f"\nSGLang weight sync payload per step (experts): BF16 {wire_bf16 / 1e9:.2f} GB (server quantizes, "
          f"{steps['build']:.1f} ms of grouped kernels on the server) vs NVFP4 {wire_fp4 / 1e9:.2f} GB "
          f"(trainer quantizes, same kernels)")
    out["wire_bytes"] = {"bf16": wire_bf16, "nvfp4": wire_fp4}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
