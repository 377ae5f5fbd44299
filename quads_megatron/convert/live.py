"""``iter_hf_weights``: stream (HF name, tensor) from a live Megatron Qwen3-MoE model, gathering TP/EP shards
(or, ``stacked_experts=True``, each layer's experts as one ``plan.ExpertsLayer``: the refit's layer stream).

This is the RL weight-sync path and the back half of the Megatron -> HF converter.  Every rank of
the model-parallel group calls it with the same arguments (it runs collectives) and receives
full tensors one parameter at a time: a tensor-parallel piece is all-gathered over (expert-)TP,
an expert over EP as well, so no rank ever holds more than one gathered parameter (times the EP
size for experts).  The tensors come out in the trainer's dtype; for the rollout engine's NVFP4
form pass the stream through ``quads_megatron.plan.quantize_named_params(stream, plan)``.
"""

import torch
import torch.distributed as dist
from tqdm import tqdm

from quads_megatron.models import qwen3_moe
from quads_megatron.convert.megatron_params import global_param_refs, parallel_info, unwrap


def _groups():
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None, None, None
    return (ps.get_tensor_model_parallel_group(), ps.get_expert_tensor_parallel_group(),
            ps.get_expert_model_parallel_group())


def _all_gather(t: torch.Tensor, group, size: int) -> list:
    if size == 1:
        return [t]
    t = t.detach().contiguous()
    out = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(out, t, group=group)
    return out


def hf_dims_of(model, vocab_size: int | None = None):
    """``qwen3_moe.Dims`` of a live model (``vocab_size``: the HF, i.e. unpadded, vocabulary)."""
    gpt = unwrap(model)
    return qwen3_moe.dims_from_megatron_config(gpt.config, vocab_size or gpt.vocab_size,
                                               gpt.share_embeddings_and_output_weights)


@torch.no_grad()
def iter_hf_weights(model, *, vocab_size: int | None = None, dtype: torch.dtype | None = None,
                    experts: str = "gather", progress: bool = False, stacked_experts: bool = False):
    """Yield ``(hf_name, tensor)`` for every weight of ``model`` (this pipeline stage's share).

    vocab_size: the HF vocabulary (Megatron's padded rows are dropped); default the model's.
    dtype: cast floating tensors (default: keep the parameter dtype).
    experts: "gather" (every rank yields all experts) or "local" (each EP rank yields only the
        experts it holds, for per-rank pushes to the rollout engine; no EP collective).
    stacked_experts: yield each layer's routed experts as one ``plan.ExpertsLayer`` (Megatron's fused
        ``[gate; up]`` fc1 and fc2 of every expert, in expert order; the parameters themselves when
        nothing is gathered) instead of 3 HF tensors per expert: the refit's layer-level stream, which
        ``plan.quantize_scale_groups`` / ``RolloutModel.load_groups`` take whole. A layer's gathered
        experts are held until the layer is complete (one layer at a time).
    """
    if experts not in ("gather", "local"):
        raise ValueError(f"experts={experts!r}: expected 'gather' or 'local'")
    stream = _iter_hf_weights(model, vocab_size, dtype, experts, progress)
    if stacked_experts:
        yield from _stack_layers(stream, shards_gathered=parallel_info()["etp_size"] > 1)
    else:
        yield from _per_expert(stream, hf_dims_of(model, vocab_size))


def _stack_layers(stream, shards_gathered: bool):
    """(name, tensor, expert info) -> the same stream with each layer's experts as one ExpertsLayer.

    Experts under AQAT (an ``ExpertsFakeQuant`` per layer and projection) carry its cached amax, so the
    build skips its amax pass; unless their shards were gathered, also the cache itself as the sink of the
    fake-quantized values, which the build writes from the same read (the next step's refresh, done)."""
    from quads_megatron.megatron.fake_quant import experts_cache_of
    from quads_megatron.plan.expert_layers import ExpertsLayer

    pending, layer = {}, None   # expert -> {"fc1": (t, param or None), "fc2": ...}

    def flush():
        order = sorted(pending)
        missing = [e for e in order if set(pending[e]) != {"fc1", "fc2"}]
        if missing:
            raise ValueError(f"iter_hf_weights: layer {layer} experts {missing[:4]} came without both fc1 and fc2")
        fc = {w: [pending[e][w] for e in order] for w in ("fc1", "fc2")}
        item = ExpertsLayer(layer, [t for t, _ in fc["fc1"]], [t for t, _ in fc["fc2"]], order)
        if all(p is not None for w in fc for _, p in fc[w]):
            caches = [experts_cache_of([p for _, p in fc[w]]) for w in ("fc1", "fc2")]
            if None not in caches:
                item.amax = tuple(c.amax() for c in caches)
                if not shards_gathered:
                    item.fake_quant = tuple(c.adopt for c in caches)
        pending.clear()
        return item

    for name, t, info in stream:
        if info is None:
            if pending and _layer_of(name) != layer:
                yield flush()
            yield name, t
            continue
        lay, expert, which, _, param = info
        if pending and lay != layer:
            yield flush()
        layer = lay
        pending.setdefault(expert, {})[which] = (t, param)
    if pending:
        yield flush()


def _layer_of(name: str):
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 3 and parts[:2] == ["model", "layers"] else None


def _iter_hf_weights(model, vocab_size, dtype, experts, progress):
    """(hf name, tensor, None) of dense weights; (None, Megatron fc1 or fc2 of one expert, (layer, expert,
    "fc1" | "fc2", rule)) of experts, gathered over (expert-)TP and, with experts="gather", EP."""
    dims = hf_dims_of(model, vocab_size)
    info = parallel_info()
    tp_group, etp_group, ep_group = _groups()
    refs = global_param_refs(model)
    num_local = max(1, (dims.num_experts or 0) // info["ep_size"])
    for ref in tqdm(refs, desc="Megatron -> HF", disable=not progress, unit="tensor"):
        rule = ref.rule
        if not rule.expert:
            full = qwen3_moe.unshard(rule, _all_gather(ref.param, tp_group, info["tp_size"]))
            for name, t in zip(qwen3_moe.hf_names(rule, ref.layer), qwen3_moe.to_hf(rule, full, dims)):
                yield name, _cast(t, dtype), None
            continue
        full = qwen3_moe.unshard(rule, _all_gather(ref.param, etp_group, info["etp_size"]))
        if experts == "gather":
            per_rank = _all_gather(full, ep_group, info["ep_size"])
            local_idx = ref.expert - info["ep_rank"] * num_local
            owned = [(r * num_local + local_idx, t) for r, t in enumerate(per_rank)]
        else:
            owned = [(ref.expert, full)]
        which = "fc1" if rule.layout == "gate_up" else "fc2"
        # the trainer's cached amax describes this tensor when it is this rank's expert (ETP-gathered: its
        # amax is MAX-reduced over ETP already) and not cast
        own = ref.param if (experts == "local" or info["ep_size"] == 1) and dtype in (None, ref.param.dtype) else None
        for expert, t_full in owned:
            yield None, _cast(t_full, dtype), (ref.layer, expert, which, rule, own)


def _per_expert(stream, dims):
    """The HF per-expert stream: every expert tensor split into its HF names (gate / up / down)."""
    for name, t, info in stream:
        if info is None:
            yield name, t
            continue
        layer, expert, _, rule, _ = info
        yield from zip(qwen3_moe.hf_names(rule, layer, expert), qwen3_moe.to_hf(rule, t, dims))


def _cast(t: torch.Tensor, dtype):
    t = t.detach()
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t
