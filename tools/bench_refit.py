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
  conversion table:   the v3 kernel-layout conversion of one layer's codes alone (in place, both ways; the
                      one-pass Triton kernel on CUDA) next to its torch definition and a device copy of
                      the same bytes.
A whole step of the layer-stream rows is one stream of all layers (as the engine's sync runs it: one host
sync, at the end), the other rows a loop over the layers.
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


def _gpu_busy_ms(fn, device) -> float:
    """Kernel and copy time on the GPU during one ``fn()`` (torch.profiler's device events, summed): against the
    call's wall time it says whether a step is bound by the GPU or by the host work between launches; NaN off a GPU."""
    if device.type != "cuda":
        return float("nan")
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(getattr(e, "self_device_time_total", 0.0) for e in prof.key_averages()) / 1e3


def _copy_bandwidth(device):
    """Device copy bandwidth in TB/s (read + write); NaN off a GPU."""
    from quads_megatron.apps.study.timing import copy_bandwidth

    return copy_bandwidth(device) / 1e12


def _layer(E, H, F, device, seed):
    """One layer's experts as separate BF16 tensors (drawn on the device: seconds less per set on a GPU)."""
    g = torch.Generator(device=device).manual_seed(seed)
    fc1 = [(torch.randn(2 * F, H, generator=g, device=device) * 0.02).to(torch.bfloat16) for _ in range(E)]
    fc2 = [(torch.randn(H, F, generator=g, device=device) * 0.02).to(torch.bfloat16) for _ in range(E)]
    return fc1, fc2


def _named(layer, fc1, fc2, F):
    """The HF-named stream the trainer's sync yields for one layer's experts."""
    pre = f"model.layers.{layer}.mlp.experts"
    for e, (w1, w2) in enumerate(zip(fc1, fc2)):
        yield f"{pre}.{e}.gate_proj.weight", w1[:F]
        yield f"{pre}.{e}.up_proj.weight", w1[F:]
        yield f"{pre}.{e}.down_proj.weight", w2


def _conversion_table(engine, run, floor, iters, out):
    """The v3 kernel-layout conversion of one layer's codes alone, in place: the one-pass Triton form
    (`kernels.fragment_convert`, the CUDA path of `to/from_fragment_order`), the layout's torch
    definition (the CPU path), and a device copy of the same bytes."""
    from quads_megatron.kernels.fragment_convert import convert_fragment_order
    from quads_megatron.kernels.fragment_layout import _from_fragment_order_torch, _to_fragment_order_torch

    def to_fragment_order(c, out):
        return convert_fragment_order(c, out, False)

    def from_fragment_order(c, out):
        return convert_fragment_order(c, out, True)

    from quads_megatron.kernels.gemm import interpreting

    if engine.w13.device.type != "cuda" and not interpreting():
        print("\n(kernel-layout conversion table: CUDA or TRITON_INTERPRET=1 only)")
        return
    codes, spare, nbytes = _layer_buffers(engine, ("w13", "w2"), 2)
    if not codes:
        return
    # correctness first: the in-place pass equals the definition, and its inverse restores the codes
    for c in codes:
        want, keep = _to_fragment_order_torch(c), c.clone()
        assert torch.equal(to_fragment_order(c, out=c), want), "kernel-layout conversion != its definition"
        assert torch.equal(from_fragment_order(c, out=c), keep), "inverse conversion did not restore the codes"
    rows = [
        ("copy", "device copy of the same bytes (baseline)", lambda: [s.copy_(c) for s, c in zip(spare, codes)]),
        ("to_kernel_layout", "one Triton pass in place (fragment_convert)",
         lambda: [to_fragment_order(c, out=c) for c in codes]),
        ("from_kernel_layout", "its inverse, one Triton pass in place",
         lambda: [from_fragment_order(c, out=c) for c in codes]),
        ("to_kernel_layout_torch", "the layout's torch definition + copy into place (the CPU path)",
         lambda: [c.copy_(_to_fragment_order_torch(c)) for c in codes]),
        ("from_kernel_layout_torch", "its inverse in torch + copy into place",
         lambda: [c.copy_(_from_fragment_order_torch(c)) for c in codes]),
    ]
    _timed_table("codes", "conversion", rows, nbytes, run, floor, iters, out)
    _scale_conversion_table(engine, run, floor, iters, out)


def _layer_buffers(engine, names, cols_per_element):
    """Copies of one layer's buffers `names` ([..., N, K / cols_per_element]) that the kernel layout holds, a spare
    buffer of each one's shape (the copy baseline's target) and their bytes."""
    from quads_megatron.plan.kernel_layout import kernel_layout_fits

    bufs = [getattr(engine, n).clone() for n in names]
    bufs = [t for t in bufs if kernel_layout_fits(t.shape[-2], cols_per_element * t.shape[-1])]
    return bufs, [torch.empty_like(t) for t in bufs], sum(t.numel() for t in bufs)


def _timed_table(what_bytes, key_prefix, rows, nbytes, run, floor, iters, out):
    """Time each (key, what, fn) of `rows` (the first: a copy of the same bytes) and print them against the copy
    and the floor (nbytes read and written at copy bandwidth); into `out` as f"{key_prefix}_{key}"."""
    fl = floor(2 * nbytes)
    print(f"\nKernel-layout conversion of one layer's {what_bytes} ({nbytes / 1e6:.1f} MB read and written), "
          f"floor {fl:.3f} ms at copy bandwidth")
    print("| what | ms | x copy | x floor |")
    print("|---|---|---|---|")
    copy_ms = None
    for key, what, fn in rows:
        ms = run(fn, iters, 2)
        copy_ms = copy_ms or ms
        print(f"| {what} | {ms:.3f} | {ms / copy_ms:.2f} | {ms / fl:.2f} |")
        out[f"{key_prefix}_{key}"] = {"layer_ms": ms, "bytes": nbytes, "x_copy": ms / copy_ms, "x_floor": ms / fl}


def _scale_conversion_table(engine, run, floor, iters, out):
    """The same for one layer's block scales: `to/from_fragment_scale_order` in place (on CUDA the one-pass Triton
    form, `fragment_convert.convert_scale_order`) and the permutation's torch definition + copy into place."""
    from quads_megatron.kernels.fragment_layout import (_scale_order_torch, from_fragment_scale_order,
                                                        to_fragment_scale_order)

    scales, spare, nbytes = _layer_buffers(engine, ("w13_scale", "w2_scale"), 16)
    if not scales:
        return
    for t in scales:  # correctness first: the inverse restores the scales
        keep = t.clone()
        to_fragment_scale_order(t, out=t)
        assert torch.equal(from_fragment_scale_order(t, out=t).view(torch.uint8), keep.view(torch.uint8))
    rows = [
        ("copy", "device copy of the same bytes (baseline)", lambda: [d.copy_(t) for d, t in zip(spare, scales)]),
        ("to_kernel_layout", "`to_fragment_scale_order` in place (CUDA: one Triton pass)",
         lambda: [to_fragment_scale_order(t, out=t) for t in scales]),
        ("from_kernel_layout", "its inverse in place", lambda: [from_fragment_scale_order(t, out=t) for t in scales]),
        ("torch_to_kernel_layout", "the permutation's torch definition + copy into place (the CPU path)",
         lambda: [t.view(torch.uint8).copy_(_scale_order_torch(t)) for t in scales]),
        ("torch_from_kernel_layout", "its inverse in torch + copy into place",
         lambda: [t.view(torch.uint8).copy_(_scale_order_torch(t, inverse=True)) for t in scales]),
    ]
    _timed_table("block scales", "scale_conversion", rows, nbytes, run, floor, iters, out)


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

    # per layer i: its own fake-quant caches and engine buffers (as in training); two weight sets alternate
    # so that no layer's data is in L2 when a whole step runs
    sets = [(fc1, fc2), _layer(E, H, F, device, 1)]
    caches = [caches] + [[ExpertsFakeQuant("fc1", sets[i % 2][0]), ExpertsFakeQuant("fc2", sets[i % 2][1])]
                         for i in range(1, L)]
    engines = [engine] + [NVFP4Experts(E, H, F, Precision.W4A4, device) for _ in range(1, L)]
    modules = [{f"model.layers.{i}.mlp.experts": m} for i, m in enumerate(engines)]

    def into_engines(lay, role, ex):  # a stream's destination: layer lay's engine buffers, written in place
        return engines[lay].grouped_buffers(role, ex)

    def refresh_old(i):        # amax pass + fake-quant pass per projection (what a step ran before)
        for c in caches[i]:
            c.invalidate()
            c.refresh()

    def amax_pass(i):          # the step's one amax pass (cached per weight version, shared below)
        for c in caches[i]:
            c.invalidate()
            c.amax()

    def refresh_cached(i):     # the refresh with the cached amax: one fake-quant launch per projection
        for c in caches[i]:
            c.refresh()

    def build_old(i, into_engine):
        w1, w2 = sets[i % 2]
        for _ in quantize_scale_groups(_named(i, w1, w2, F), plan, destination=into_engines if into_engine else None):
            pass

    def old_per_expert(i):     # before the grouped kernels: one quantize per scale group, a copy per tensor
        w1, w2 = sets[i % 2]
        for names, tensors, _ in groups:
            qs = nvfp4.quantize_with_shared_scale(tensors) if len(tensors) > 1 else [nvfp4.quantize(tensors[0])]
            for n, t, q in zip(names, tensors, qs):
                load_quantized(modules[0], n, t, q)

    def layer_items(layers, amax=False, refit=False):
        for i in layers:
            w1, w2 = sets[i % 2]
            item = ExpertsLayer(i, w1, w2)
            if amax or refit:
                item.amax = tuple(c.amax() for c in caches[i])
            if refit:
                item.fake_quant = tuple(c.adopt for c in caches[i])
            yield item

    def build_layers(layers, into_engine=False, views=False, amax=False, refit=False):
        """The layer stream of `layers` through one ``quantize_scale_groups`` call, as a sync runs it (the
        NaN/Inf check of the scales is its one host sync, at the end)."""
        for q in quantize_scale_groups(layer_items(layers, amax, refit), plan,
                                       destination=into_engines if into_engine else None):
            if views:
                for _ in rollout_items(q):
                    pass

    def each(per_layer):       # a row of per-layer work: a loop over the layers
        return lambda layers: [per_layer(i) for i in layers]

    def step_old(i):           # a step's refit before: refresh (2 passes) + build + load (per-expert stream)
        refresh_old(i)
        build_old(i, True)

    def step_new(layers):      # a step's refit now: one amax pass per layer, then refresh + build + load from one read
        for i in layers:
            amax_pass(i)
        build_layers(layers, into_engine=True, refit=True)

    def refit_kernel_layout(layers):
        build_layers(layers, into_engine=True, refit=True)
        for i in layers:
            engines[i].settle_load()

    # correctness of the new paths on layer 0: the engine's bytes and the AQAT cache equal the old paths'
    ref = NVFP4Experts(E, H, F, Precision.W4A4, device)
    for _ in quantize_scale_groups(_named(0, fc1, fc2, F), plan,
                                   destination=lambda lay, role, ex, m=ref: m.grouped_buffers(role, ex)):
        pass
    ptr = engine.w13.data_ptr()
    ref_fake = [c.refresh().clone() for c in caches[0]]
    step_new([0])
    assert engine.w13.data_ptr() == ptr, "the layer stream rebound the engine's buffers"
    for n in ("w13", "w13_scale", "w13_scale_2", "w2", "w2_scale", "w2_scale_2"):
        assert torch.equal(getattr(engine, n).view(torch.uint8), getattr(ref, n).view(torch.uint8)), n
    for c, want in zip(caches[0], ref_fake):
        assert torch.equal(c._value.view(torch.int16), want.view(torch.int16)), f"{c.name}: refit pass != refresh"
    del ref, ref_fake
    print("correctness: the layer stream and the one-read refit pass write the old paths' bytes, in place")

    B_IN, B_FQ, B_NV = 2.0, 2.0, 0.5625  # per parameter: read BF16, write BF16 fake-quant, write codes + scales
    # key, what, work on a list of layers, bytes moved per parameter by design, floor bytes per parameter (the
    # result's own). The layer-stream rows run their layers as one stream (one host sync), as the engine's sync does.
    rows = [
        ("refresh", "(a) AQAT refresh, amax + fake-quant passes (old)", each(refresh_old), 2 * B_IN + B_FQ,
         B_IN + B_FQ),
        ("amax", "(a1) amax pass (once per step, shared by (a2), (c3), (d))", each(amax_pass), B_IN, B_IN),
        ("refresh_cached", "(a2) AQAT refresh with the step's amax", each(refresh_cached), B_IN + B_FQ, B_IN + B_FQ),
        ("build_load", "(c) build + load in place, per-expert HF stream (old)", each(lambda i: build_old(i, True)),
         2 * B_IN + B_NV, B_IN + B_NV),
        ("build_load_layer", "(c2) build + load in place, layer stream", lambda ls: build_layers(ls, True),
         2 * B_IN + B_NV, B_IN + B_NV),
        ("build_load_layer_amax", "(c3) build + load in place, layer stream, the step's amax",
         lambda ls: build_layers(ls, True, amax=True), B_IN + B_NV, B_IN + B_NV),
        ("refit", "(d) refresh + build + load in place from one read, the step's amax",
         lambda ls: build_layers(ls, True, refit=True), B_IN + B_FQ + B_NV, B_IN + B_FQ + B_NV),
        ("refit_kernel_layout", "(d2) (d) + the v3 kernel-layout conversion of codes and scales in place (settle_load)",
         refit_kernel_layout, B_IN + B_FQ + 3 * B_NV, B_IN + B_FQ + B_NV),  # NVFP4 bytes written, read + written
        ("step_old", "(e) a step's refit before: (a) + (c)", each(step_old), 4 * B_IN + B_FQ + B_NV,
         B_IN + B_FQ + B_NV),
        ("step_new", "(f) a step's refit now: (a1) + (d)", step_new, 2 * B_IN + B_FQ + B_NV, B_IN + B_FQ + B_NV),
        ("build", "(b) build NVFP4, per-expert HF stream (old)", each(lambda i: build_old(i, False)),
         2 * B_IN + B_NV, B_IN + B_NV),
        ("build_layer", "(b2) build NVFP4, layer stream (ExpertsLayer)", build_layers, 2 * B_IN + B_NV, B_IN + B_NV),
        ("build_layer_views", "(b3) (b2) + per-expert ModelOpt views (SGLang wire names)",
         lambda ls: build_layers(ls, views=True), 2 * B_IN + B_NV, B_IN + B_NV),
    ]
    reps = max(1, a.iters // 2)
    old_ms = run(lambda: old_per_expert(0), reps, 1)
    name = f"{L} layers x {E} experts, hidden {H}, FFN {F}, {device}" + (
        f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else "")
    print(f"Refit per RL step: {name}; device copy {bw:.2f} TB/s; floors: the result's own bytes at copy bandwidth")
    print("| what | B/param moved | floor B/param | one layer ms | x floor | whole step ms (all layers) | step x floor "
          "| GPU busy in the step ms |")
    print("|---|---|---|---|---|---|---|---|")
    out = {"layers": L, "experts": E, "hidden": H, "ffn": F, "copy_tb_s": bw, "old_per_expert_build_load_ms": old_ms}

    def save():
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1)
    for key, what, fn, moved, floor_b in rows:
        one = run(lambda: fn([0]), a.iters, 2)
        step = run(lambda: fn(range(L)), reps, 1)
        busy = _gpu_busy_ms(lambda: fn(range(L)), device)
        fl = floor(params * floor_b)
        print(f"| {what} | {moved:.4g} | {floor_b:.4g} | {one:.3f} | {one / fl:.2f} | {step:.1f} | "
              f"{step / (fl * L):.2f} | {busy:.1f} |")
        out[key] = {"layer_ms": one, "step_ms": step, "floor_layer_ms": fl, "bytes_per_param": moved,
                    "floor_bytes_per_param": floor_b, "x_floor": one / fl, "step_x_floor": step / (fl * L),
                    "step_gpu_busy_ms": busy}
        save()  # row by row: a run cut short by its time limit keeps what it measured
    fl = floor(params * (B_IN + B_NV))
    print(f"| before the grouped kernels: per-expert quantize + copy into the engine | {2 * B_IN + B_NV:.4g} | "
          f"{B_IN + B_NV:.4g} | {old_ms:.3f} | {old_ms / fl:.2f} | {old_ms * L:.1f} (x{L}) | - | - |")
    _conversion_table(engine, run, floor, a.iters, out)
    save()
    wire_bf16, wire_fp4 = params * 2 * L, params * 0.5625 * L + 4 * 2 * E * L
    print(f"\nSGLang weight sync payload per step (experts): BF16 {wire_bf16 / 1e9:.2f} GB (server quantizes, "
          f"{out['build_layer']['step_ms']:.1f} ms of grouped kernels on the server) vs NVFP4 "
          f"{wire_fp4 / 1e9:.2f} GB (trainer quantizes, same kernels)")
    out["wire_bytes"] = {"bf16": wire_bf16, "nvfp4": wire_fp4}
    save()


if __name__ == "__main__":
    main()
