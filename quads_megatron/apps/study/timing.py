"""Time one MoE experts module (the rollout engine's, any precision) on random routing; CUDA-graph replay on a GPU."""

from __future__ import annotations

import time

import torch


def random_routing(tokens: int, num_experts: int, top_k: int, device, seed: int = 0):
    """(top_k_index [T, k] int64, top_k_weights [T, k] fp32): random logits, top-k, renormalised softmax."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    logits = torch.randn(tokens, num_experts, generator=g)
    w, idx = torch.softmax(logits, -1).topk(top_k, dim=-1)
    return idx.to(device), (w / w.sum(-1, keepdim=True)).to(device)


def capturable(module) -> bool:
    """Our NVFP4 experts, and transformers' experts on its grouped_mm path (the local engine's BF16 on a GPU)."""
    from quads_megatron.rl.engines.precision import graph_safe

    impl = getattr(getattr(module, "config", None), "_experts_implementation", None)
    return graph_safe(module) or impl == "grouped_mm"


@torch.no_grad()
def time_experts(module, tokens: int, hidden: int, num_experts: int, top_k: int, dtype, device,
                 repeats: int = 50, seed: int = 0) -> dict:
    """Median ms of ``module(x, top_k_index, top_k_weights)``; on CUDA replayed from a graph when ``capturable``."""
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    x = torch.randn(tokens, hidden, generator=g).to(device=device, dtype=dtype)
    idx, w = random_routing(tokens, num_experts, top_k, device, seed)
    if device.type != "cuda":
        module(x, idx, w)
        times = []
        for _ in range(max(3, repeats // 10)):
            t0 = time.perf_counter()
            module(x, idx, w)
            times.append((time.perf_counter() - t0) * 1e3)
        return {"ms": sorted(times)[len(times) // 2], "cuda_graph": False}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            module(x, idx, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph, run = None, (lambda: module(x, idx, w))
    if capturable(module):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            module(x, idx, w)
        run = graph.replay
    for _ in range(5):
        run()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return {"ms": sorted(times)[len(times) // 2], "cuda_graph": graph is not None}


def graph_replay_ms(fn, iters: int, reps: int = 10, warmup: int = 3) -> float:
    """Median CUDA ms per call of ``fn``: ``reps`` calls captured in one CUDA graph (warmed up on a side
    stream first, so Triton compiles and cuBLAS handles stay out of the capture), replays timed with
    events; host launch overhead stays out, as SGLang decodes under graphs. The benchmarks' one timer."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / reps)
    del graph
    return sorted(ts)[len(ts) // 2]
