"""`--load-format dummy` for quads layers: random weights of SGLang's dummy range, quantized by the project's NVFP4.

SGLang's dummy loader (speed benchmarks, no checkpoint read) fills every floating parameter with
uniform(-1e-3, 1e-3) and leaves integer ones as allocated, then calls `process_weights_after_loading`.
For a quads layer that would be packed codes of whatever the memory held, E4M3 block scales rounded from
1e-3 and no RAC channels, which the completeness check refuses. Under that load format the quads methods
instead draw the same uniform(-1e-3, 1e-3) BF16 weights (seeded per layer) and quantize them with
`quads_megatron.nvfp4` / `plan.quantize_experts_layer`, as an export or a weight sync would; RAC channels
are a seeded random sorted set (there is no calibration to choose them), static input scales those of
an activation amax of 1 (`STATIC_INPUT_AMAX`: hidden states after RMSNorm are O(1)). The
served model is as meaningless as SGLang's dummy BF16 one and runs the same kernels at the same cost.
"""

from __future__ import annotations

import zlib

import torch

from quads_megatron import nvfp4
from quads_megatron.plan import ExpertsLayer, quantize_experts_layer

DUMMY_RANGE = 1e-3  # SGLang's initialize_dummy_weights range
DUMMY_SEED = 1234   # SGLang's initialize_dummy_weights seed
STATIC_INPUT_AMAX = 1.0  # the activation amax behind a dummy static input scale


def requested() -> bool:
    """True when this server process was started with `--load-format dummy` (SGLang's runtime context)."""
    try:
        from sglang.srt.runtime_context import get_model

        return get_model().load_format == "dummy"
    except (ImportError, AttributeError, RuntimeError, KeyError):  # no published context: a real load
        return False


def _generator(device: torch.device, key: str) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(DUMMY_SEED + zlib.crc32(key.encode()))


def _static_input_scale() -> float:
    return float(nvfp4.global_decode_scale(torch.tensor(STATIC_INPUT_AMAX)))


def _uniform(shape, gen: torch.Generator, device) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.bfloat16, device=device).uniform_(-DUMMY_RANGE, DUMMY_RANGE,
                                                                              generator=gen)


def channels(k_in: int, k: int, gen: torch.Generator, device) -> torch.Tensor:
    """k distinct input channels of [0, k_in), sorted (what `check_comp_index_values` asks of a RAC set)."""
    return torch.randperm(k_in, generator=gen, device=device)[:k].sort().values.to(torch.int32)


def fill_moe(layer: torch.nn.Module, rollout, key: str) -> None:
    """Every local expert of a quads FusedMoE: fc1 [E, 2F, H] and fc2 [E, H, F] drawn and quantized (one
    global scale per expert and projection, gate and up shared), RAC channels and static input scales set."""
    e, two_f, h = layer.w13_weight.shape[0], layer.w13_weight.shape[1], layer.w13_weight.shape[2] * 2
    f, dev = two_f // 2, layer.w13_weight.device
    gen = _generator(dev, key)
    q = quantize_experts_layer(ExpertsLayer(getattr(layer, "layer_id", 0), _uniform((e, two_f, h), gen, dev),
                                            _uniform((e, h, f), gen, dev)))
    for pname, t in (("w13_weight", q.fc1.data), ("w13_weight_scale", q.fc1.scale),
                     ("w2_weight", q.fc2.data), ("w2_weight_scale", q.fc2.scale)):
        p = getattr(layer, pname)
        p.data.copy_(t.view(p.dtype))
    layer.w13_weight_scale_2.data.copy_(q.fc1.global_scale.reshape(e, 1).expand(e, 2))
    layer.w2_weight_scale_2.data.copy_(q.fc2.global_scale.reshape(e))
    layer.w13_input_scale.data.fill_(_static_input_scale())
    layer.w2_input_scale.data.fill_(_static_input_scale())
    if rollout.uses_rac:
        k = rollout.rac_channels
        layer.w13_input_comp_index.data.copy_(channels(h, k, gen, dev).expand(e, 2, k))
        layer.w2_input_comp_index.data.copy_(torch.stack([channels(f, k, gen, dev) for _ in range(e)]))


def fill_linear(layer: torch.nn.Module, rollout, key: str) -> None:
    """A quads linear (all its logical shards): one [N, K] weight drawn and quantized with one global scale
    and one RAC set (the shards read one input), so merged shards stay one GEMM; the dummy static input scale."""
    n, k_in, dev = layer.weight.shape[0], layer.weight.shape[1] * 2, layer.weight.device
    gen = _generator(dev, key)
    q = nvfp4.quantize(_uniform((n, k_in), gen, dev), name=f"{key}.weight (dummy)")
    layer.weight.data.copy_(q.data)
    layer.weight_scale.data.copy_(q.scale.view(layer.weight_scale.dtype))
    layer.weight_scale_2.data.copy_(q.global_scale.reshape(()).expand_as(layer.weight_scale_2))
    layer.input_scale.data.fill_(_static_input_scale())
    if rollout.uses_rac:
        shards, k = len(layer.logical_widths), rollout.rac_channels
        layer.input_comp_index.data.copy_(channels(k_in, k, gen, dev).repeat(shards))  # the shards' one input
