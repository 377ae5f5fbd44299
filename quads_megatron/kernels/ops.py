"""Public rollout ops `w4a4_linear` and `w4a4_fused_moe` (docs/interfaces.md): validation, dispatch, launches.

RAC on Hopper runs the residual exactly: k extra K-steps of fp16 MMA in the GEMM over the
residual tile (own per-row S_dec) and the stored weight columns Wq[:, S]
(`rac_columns.rac_weight_columns`: pass them as `comp_weight` / `w13_comp_weight` /
`w2_comp_weight`, built once per weight; without them they are built per call), equal to the
reference at fp32-accumulation level. The torch reference ignores them (it indexes the
dequantized weight).

Dispatch, once per call, by `quads_megatron.nvfp4.resolve_backend(x.device, backend)`
(`backend=` argument, else QUADS_BACKEND, else Triton on CUDA and torch on CPU): "torch" runs
the torch reference (`reference.py`, the same function); "triton" runs the Triton kernels (on
CPU tensors in Triton's interpreter, TRITON_INTERPRET=1, as in the kernel tests); on SM100+
with FlashInfer installed the dense W4A4 linear takes the native FP4 path (`blackwell.py`).
The dense W4A4 linear runs as the act_quant pre-pass + GEMM (a one-launch form with the activation
quantized inside the GEMM measured slower at every M on the H200: docs/benchmarks.md section 6).
`check_inputs=False` skips the value checks that sync the host (comp_index range and order,
expert ids); shape and dtype checks always run, and value checks are skipped automatically
while a CUDA graph is being captured.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from quads_megatron.nvfp4 import resolve_backend

from . import reference
from ._checks import (check_act_mode, check_activation, check_comp, check_comp_weight,
                      check_moe_inputs, check_packed_weight)
from .act_quant import quantize_activation_rac
from .combine import topk_sum
from .fragment_layout import check_fragment_shape, fragment_columns, from_fragment_order, from_fragment_scale_order
from .gemm import default_config, device_sms, fragment_config, grouped_split_k, launch_gemm
from .rac_columns import rac_weight_columns
from .routing import moe_align_block_size
from .silu_mul import silu_and_mul

__all__ = ["w4a4_linear", "w4a4_fused_moe", "moe_configs", "WEIGHT_LAYOUTS"]

# "modelopt": packed codes and block scales as in the checkpoint (the v2 main loop); "fragment": the codes
# in `fragment_layout.to_fragment_order`'s byte order, the block scales in `to_fragment_scale_order`'s (v3)
WEIGHT_LAYOUTS = ("modelopt", "fragment")


def _check_layout(weight_layout: str, **weights) -> bool:
    """True for fragment-order weights (their N / K multiples checked on the codes; `check_packed_weight`
    matched the scales' shape to them), False for ModelOpt's."""
    if weight_layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight_layout: expected one of {WEIGHT_LAYOUTS}, got {weight_layout!r}")
    if weight_layout == "fragment":
        for name, w in weights.items():
            check_fragment_shape(w, name)
    return weight_layout == "fragment"


@functools.lru_cache(maxsize=None)
def _k_order(k: int, device: torch.device) -> torch.Tensor:
    """`fragment_columns(k)` on `device`, built once (the W4A16 activations' gather index)."""
    return fragment_columns(k, device)


def _rac_columns(weight: torch.Tensor, weight_scale: torch.Tensor, comp: torch.Tensor,
                 frag: bool) -> torch.Tensor:
    """RAC weight columns built per call (a loader builds them once): from the ModelOpt codes and scales,
    so fragment-order weights are read back first."""
    if frag:
        weight, weight_scale = from_fragment_order(weight), from_fragment_scale_order(weight_scale)
    return rac_weight_columns(weight, weight_scale, comp)


def _same_device(x: torch.Tensor, **tensors) -> None:
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.device != x.device:
            raise ValueError(f"{name}: on {t.device}, but x is on {x.device}")


def w4a4_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                weight_scale_2: torch.Tensor, *, act_mode: str,
                comp_index: Optional[torch.Tensor] = None, input_scale=None,
                bias: Optional[torch.Tensor] = None, backend: Optional[str] = None,
                check_inputs: bool = True,
                comp_weight: Optional[torch.Tensor] = None,
                weight_layout: str = "modelopt") -> torch.Tensor:
    """y = x Wq^T (+ bias) with NVFP4 weights; act_mode w4a4 | w4a4_rac | w4a16. x [..., K] -> [..., N].

    backend: "triton" | "torch" | None (`resolve_backend`); check_inputs=False: no host-syncing
    value checks; comp_weight: fp16 [N, k] = rac_weight_columns(weight, weight_scale,
    comp_index) (w4a4_rac; built per call when None); weight_layout: "modelopt" or "fragment"
    (`WEIGHT_LAYOUTS`)."""
    check_act_mode(act_mode)
    n, k = check_packed_weight(weight, weight_scale, weight_scale_2, ndim=2, name="weight")
    check_activation(x, k)
    comp = check_comp(act_mode, comp_index, k, check_inputs=check_inputs)
    if comp is not None and comp.ndim != 1:
        raise ValueError("comp_index: a dense linear takes one set [k]")
    check_comp_weight(comp_weight, comp, (n,), "comp_weight")
    _same_device(x, weight=weight, weight_scale=weight_scale, weight_scale_2=weight_scale_2,
                 comp_index=comp, bias=bias, comp_weight=comp_weight if comp is not None else None)
    frag = _check_layout(weight_layout, weight=weight)
    if resolve_backend(x.device, backend) == "torch":
        if frag:
            weight, weight_scale = from_fragment_order(weight), from_fragment_scale_order(weight_scale)
        return reference.w4a4_linear(x, weight, weight_scale, weight_scale_2, act_mode=act_mode,
                                     comp_index=comp_index, input_scale=input_scale, bias=bias,
                                     check_inputs=False)
    if act_mode == "w4a4" and x.is_cuda and not frag:
        from . import blackwell

        if blackwell.available(x.device):
            return blackwell.w4a4_linear_fp4(x, weight, weight_scale, weight_scale_2,
                                             input_scale, bias)
    x2d = x.reshape(-1, k).contiguous()
    m = x2d.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*x.shape[:-1], n)
    w, ws, ws2 = weight.unsqueeze(0), weight_scale.unsqueeze(0), weight_scale_2.reshape(1)
    b = None if bias is None else bias.to(torch.float32).contiguous()
    if act_mode == "w4a16":
        a = x2d[:, _k_order(k, x.device)].contiguous() if frag else x2d
        launch_gemm(a, None, w, ws, ws2, out, m=m, w4a16=True, bias=b, fragment_layout=frag)
    else:
        cols = None
        if comp is not None:
            cols = comp_weight if comp_weight is not None else _rac_columns(weight, weight_scale, comp, frag)
        qa = quantize_activation_rac(x2d, comp, input_scale, fragment_order=frag)
        r = None if comp is None else (qa.r_values, qa.r_s_dec)
        launch_gemm(qa.values, qa.s_dec, w, ws, ws2, out, m=m, r=r,
                    comp_weight=None if cols is None else cols.unsqueeze(0), bias=b,
                    fragment_layout=frag)
    return out.view(*x.shape[:-1], n)


def moe_configs(m: int, num_experts: int, hidden: int, f: int, rac13: bool, rac2: bool, frag: bool,
                num_sms: int) -> tuple:
    """The (fc1, fc2) `GemmConfig`s `w4a4_fused_moe` launches for m routed rows: the tile by rows per
    expert (`fragment_config` / `default_config`), fc2 on fc1's block_m (the routing's block), and K
    split at batch 1-2 where too few tiles fill the GPU (`grouped_split_k`; num_sms 0: no split)."""
    pick = fragment_config if frag else default_config
    cfg1 = pick(m / num_experts, 2 * f, hidden, rac=rac13)
    cfg2 = pick(m / num_experts, hidden, f, rac=rac2)._replace(block_m=cfg1.block_m)
    if num_sms:
        cfg1 = cfg1._replace(split_k=grouped_split_k(m, num_experts, 2 * f, hidden, cfg1, num_sms))
        cfg2 = cfg2._replace(split_k=grouped_split_k(m, num_experts, hidden, f, cfg2, num_sms))
    return cfg1, cfg2


def w4a4_fused_moe(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
                   w13_scale_2: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                   w2_scale_2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   *, act_mode: str, w13_comp_index: Optional[torch.Tensor] = None,
                   w2_comp_index: Optional[torch.Tensor] = None, w13_input_scale=None,
                   w2_input_scale=None, backend: Optional[str] = None,
                   check_inputs: bool = True, w13_comp_weight: Optional[torch.Tensor] = None,
                   w2_comp_weight: Optional[torch.Tensor] = None,
                   configs: Optional[tuple] = None,
                   weight_layout: str = "modelopt",
                   align_block_size: Optional[Callable] = None) -> torch.Tensor:
    """NVFP4 MoE: out[t] = sum_j w_tj * fc2_e(SiLU(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, j].

    backend and check_inputs as in `w4a4_linear`; w13_comp_weight fp16 [E, 2F, k] /
    w2_comp_weight fp16 [E, H, k]: rac_weight_columns of w13 / w2 at their channels (w4a4_rac;
    built per call when None); configs: (fc1, fc2) `GemmConfig`s instead of `default_config`'s /
    `fragment_config`'s (as SGLang's override_config; fc2 runs with fc1's block_m, the routing's block);
    weight_layout: "modelopt" or "fragment" (w13 and w2 and their block scales in `fragment_layout`'s
    orders, the v3 main loop; the reference backend and per-call RAC columns convert them back); align_block_size:
    (topk_ids, block_m, num_experts) -> (sorted_ids, expert_ids, num_tokens_post_padded) in
    SGLang's `moe_align_block_size` contract (pad id = topk_ids.numel(), blocks past the total
    unread), e.g. SGLang's own CUDA op inside its server; default `routing.moe_align_block_size`.
    The order of rows within an expert does not change the output: each row is computed alone."""
    num_experts, hidden, f, c13, c2 = check_moe_inputs(
        x, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, topk_weights, topk_ids,
        act_mode, w13_comp_index, w2_comp_index, check_inputs)
    check_comp_weight(w13_comp_weight, c13, (num_experts, 2 * f), "w13_comp_weight")
    check_comp_weight(w2_comp_weight, c2, (num_experts, hidden), "w2_comp_weight")
    _same_device(x, w13=w13, w2=w2, topk_ids=topk_ids, topk_weights=topk_weights,
                 w13_comp_index=c13, w2_comp_index=c2,
                 w13_comp_weight=w13_comp_weight if c13 is not None else None,
                 w2_comp_weight=w2_comp_weight if c2 is not None else None)
    frag = _check_layout(weight_layout, w13=w13, w2=w2)
    if resolve_backend(x.device, backend) == "torch":
        if frag:
            w13, w2 = from_fragment_order(w13), from_fragment_order(w2)
            w13_scale, w2_scale = from_fragment_scale_order(w13_scale), from_fragment_scale_order(w2_scale)
        return reference.w4a4_fused_moe(
            x, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, topk_weights, topk_ids,
            act_mode=act_mode, w13_comp_index=w13_comp_index, w2_comp_index=w2_comp_index,
            w13_input_scale=w13_input_scale, w2_input_scale=w2_input_scale, check_inputs=False)
    tokens, topk = topk_ids.shape
    m = tokens * topk
    if m == 0:
        return torch.zeros(tokens, hidden, dtype=x.dtype, device=x.device)
    x = x.contiguous()
    if configs is None:
        cfg1, cfg2 = moe_configs(m, num_experts, hidden, f, c13 is not None, c2 is not None, frag,
                                 device_sms(x.device))
    else:
        cfg1, cfg2 = configs[0], configs[1]._replace(block_m=configs[0].block_m)
    routing = (align_block_size or moe_align_block_size)(topk_ids, cfg1.block_m, num_experts)
    ws13_2 = w13_scale_2.reshape(-1).to(torch.float32).contiguous()
    ws2_2 = w2_scale_2.reshape(-1).to(torch.float32).contiguous()
    inter = torch.empty(m, 2 * f, dtype=x.dtype, device=x.device)
    if act_mode == "w4a16":
        xa = x[:, _k_order(hidden, x.device)].contiguous() if frag else x
        launch_gemm(xa, None, w13, w13_scale, ws13_2, inter, m=m, w4a16=True,
                    routing=routing, a_row_div=topk, config=cfg1, fragment_layout=frag)
        h = silu_and_mul(inter)
        if frag:
            h = h[:, _k_order(f, x.device)].contiguous()
    else:
        qa = quantize_activation_rac(x, c13, w13_input_scale, fragment_order=frag)
        r = None if c13 is None else (qa.r_values, qa.r_s_dec)
        if c13 is not None and w13_comp_weight is None:
            w13_comp_weight = _rac_columns(w13, w13_scale, c13, frag)
        launch_gemm(qa.values, qa.s_dec, w13, w13_scale, ws13_2, inter, m=m, r=r,
                    comp_weight=w13_comp_weight if r is not None else None, routing=routing,
                    a_row_div=topk, config=cfg1, fragment_layout=frag)
    rows = torch.empty(m, hidden, dtype=x.dtype, device=x.device)
    tw = topk_weights.reshape(-1).to(torch.float32).contiguous()
    if act_mode == "w4a16":
        launch_gemm(h, None, w2, w2_scale, ws2_2, rows, m=m, w4a16=True, routing=routing,
                    topk_weights=tw, config=cfg2, fragment_layout=frag)
    else:
        groups = topk_ids.reshape(-1) if c2 is not None and c2.ndim == 2 else None
        qh = quantize_activation_rac(inter, c2, w2_input_scale, groups, silu_mul=True,
                                     fragment_order=frag)
        r = None if c2 is None else (qh.r_values, qh.r_s_dec)
        if c2 is not None and w2_comp_weight is None:
            w2_comp_weight = _rac_columns(w2, w2_scale, c2, frag)
        launch_gemm(qh.values, qh.s_dec, w2, w2_scale, ws2_2, rows, m=m, r=r,
                    comp_weight=w2_comp_weight if r is not None else None, routing=routing,
                    topk_weights=tw, config=cfg2, fragment_layout=frag)
    return topk_sum(rows, topk)
