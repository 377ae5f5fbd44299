"""The one timer of every benchmark (``time_ms``), and the MoE experts timing of the studies built on it.

``time_ms(fn, device=..., mode=...)`` returns the median milliseconds per call of ``fn``:

* ``"graph"`` (CUDA): ``reps`` calls captured in one CUDA graph after a warm-up on a side stream (so
  Triton compiles and cuBLAS handles stay out of the capture), replays timed with CUDA events: host
  launch overhead stays out, as SGLang decodes under graphs.
* ``"events"`` (CUDA): CUDA events around each eager call (what one call costs on the GPU, launch gaps
  included; for work a graph cannot hold: backward passes, allocations, copies).
* ``"wall"``: ``time.perf_counter`` around each call with the device synchronized before and after (host
  work included: a whole ``generate()``, a weight update through a server).

On a CPU every mode is ``perf_counter`` per call.  Tools (``tools/bench_*.py``, ``tools/paper_*.py``)
and the studies call this module only; none keeps a timing loop of its own.
"""

from __future__ import annotations

import time

import torch

MODES = ("graph", "events", "wall")


def _median(values) -> float:
    values = sorted(values)
    return values[len(values) // 2]


def _is_cuda(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def time_ms(fn, *, device, iters: int = 20, warmup: int = 3, mode: str = "events", reps: int = 10) -> float:
    """Median milliseconds per call of ``fn()`` on ``device`` after ``warmup`` calls (see the module doc for
    ``mode``; ``reps``: calls per captured graph in ``"graph"`` mode)."""
    if mode not in MODES:
        raise ValueError(f"time_ms: mode {mode!r}, expected one of {MODES}")
    if iters < 1:
        raise ValueError(f"time_ms: iters {iters}, expected >= 1")
    cuda = _is_cuda(device)
    if cuda and mode == "graph":
        return _graph_replay_ms(fn, iters, reps, warmup)
    for _ in range(warmup):
        fn()
    times = []
    if cuda and mode == "events":
        torch.cuda.synchronize()
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        return _median(times)
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return _median(times)


def capture_graph(fn, warmup: int = 1) -> tuple:
    """(CUDA graph, its static output) of ``fn()``, captured after ``warmup`` calls on a side stream (Triton
    compiles and cuBLAS handles stay out of the capture, as in SGLang's graph runner)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(max(1, warmup)):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def _graph_replay_ms(fn, iters: int, reps: int, warmup: int) -> float:
    def calls():
        for _ in range(reps):
            fn()

    graph, _ = capture_graph(calls, warmup)
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
    return _median(ts)


def copy_bandwidth(device, nbytes: int = 1 << 30) -> float:
    """Bytes read + written per second of a device-to-device copy of ``nbytes`` (``"events"``, median of 20):
    the roofline the benchmarks compare against; NaN off a GPU."""
    if not _is_cuda(device):
        return float("nan")
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device=device, iters=20, warmup=1, mode="events")
    return 2 * nbytes / (ms * 1e-3)


def random_routing(tokens: int, num_experts: int, top_k: int, device, seed: int = 0):
    """(top_k_index [T, k] int64, top_k_weights [T, k] fp32): random logits, top-k, renormalised softmax."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    logits = torch.randn(tokens, num_experts, generator=g)
    w, idx = torch.softmax(logits, -1).topk(top_k, dim=-1)
    return idx.to(device), (w / w.sum(-1, keepdim=True)).to(device)


def capturable(module) -> bool:
    """Our NVFP4 experts, and transformers' experts on its grouped_mm path (the local engine's BF16 on a GPU)."""
    from quads_megatron.rollout.modules import graph_safe

    impl = getattr(getattr(module, "config", None), "_experts_implementation", None)
    return graph_safe(module) or impl == "grouped_mm"


@torch.no_grad()
def time_experts(module, tokens: int, hidden: int, num_experts: int, top_k: int, dtype, device,
                 repeats: int = 50, seed: int = 0) -> dict:
    """Median ms of ``module(x, top_k_index, top_k_weights)``; on CUDA replayed from a graph when ``capturable``
    (``time_ms`` "graph", one call per graph), else CUDA events per call; on CPU ``perf_counter``."""
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    x = torch.randn(tokens, hidden, generator=g).to(device=device, dtype=dtype)
    idx, w = random_routing(tokens, num_experts, top_k, device, seed)
    graph = _is_cuda(device) and capturable(module)
    iters = repeats if _is_cuda(device) else max(3, repeats // 10)
    ms = time_ms(lambda: module(x, idx, w), device=device, iters=iters, warmup=3 if _is_cuda(device) else 1,
                 mode="graph" if graph else "events", reps=1)
    return {"ms": ms, "cuda_graph": graph}
