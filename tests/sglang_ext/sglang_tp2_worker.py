"""One rank of the TP = 2 check (run as `python sglang_tp2_worker.py RANK PORT`, two ranks over gloo).

Each rank builds SGLang's QKV / Row parallel linears and a FusedMoE (expert TP, then expert
parallelism with RAC) with the quads methods, feeds them the *full* checkpoint tensors through SGLang's loaders (which shard them),
and checks its output against the kernel reference on the slice of the checkpoint it owns.
Exits non-zero with the failing check's message.
"""

from __future__ import annotations

import os
import sys

import torch

from sglang_fixtures import comp_index, input_scale, load_experts, nvfp4_gate_up, nvfp4_linear
from quads_megatron.errors import ConfigError

TP = 2


def init(rank: int, port: int):
    """World of 2 over gloo with SGLang's TP (and expert-TP) group spanning both ranks.

    SGLang's initialize_model_parallel would open a PyNccl communicator for a 2-rank group (the
    CUDA torch build does not know it runs on CPU), so the groups are built with SGLang's own
    init_model_parallel_group(use_pynccl=False) and installed as initialize_model_parallel does.
    """
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    load_plugins()
    ps.init_distributed_environment(world_size=TP, rank=rank, local_rank=rank, backend="gloo",
                                    distributed_init_method=f"tcp://127.0.0.1:{port}")
    reset_context()
    publish(ServerArgs(model_path="dummy", tp_size=TP), role="test", ranks=SpawnRanks(world_rank=rank))
    opts = dict(use_pynccl=False, use_custom_allreduce=False, use_mscclpp=False,
                use_torch_symm_mem_allreduce=False)
    tp = ps.init_model_parallel_group([list(range(TP))], rank, "gloo", group_name="tp", **opts)
    ep = ps.init_model_parallel_group([[r] for r in range(TP)], rank, "gloo", group_name="moe_ep",
                                      **opts)
    ps._TP = ps._ATTN_TP = ps._MOE_TP = ps._MOE_DP = tp
    ps._MOE_EP = ep
    get_parallel().override_permanently(world_group=ps._WORLD, tp_group=tp, attn_tp_group=tp,
                                        moe_tp_group=tp, moe_dp_group=tp, moe_ep_group=ep)


def init_ep(rank: int) -> None:
    """Re-publish as TP = EP = 2 (expert parallelism: each rank owns 2 of the 4 experts)."""
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    reset_context()
    publish(ServerArgs(model_path="dummy", tp_size=TP, ep_size=TP), role="test",
            ranks=SpawnRanks(world_rank=rank))
    opts = dict(use_pynccl=False, use_custom_allreduce=False, use_mscclpp=False,
                use_torch_symm_mem_allreduce=False)
    tp = ps.init_model_parallel_group([list(range(TP))], rank, "gloo", group_name="tp", **opts)
    mtp = ps.init_model_parallel_group([[r] for r in range(TP)], rank, "gloo", group_name="moe_tp",
                                       **opts)
    ps._TP = ps._ATTN_TP = ps._MOE_EP = ps._MOE_DP = tp
    ps._MOE_TP = mtp
    get_parallel().override_permanently(world_group=ps._WORLD, tp_group=tp, attn_tp_group=tp,
                                        moe_ep_group=tp, moe_dp_group=tp, moe_tp_group=mtp)


def config(mode: str, scaling: str = "static"):
    from quads_megatron.plan.rollout_schema import RolloutQuantConfig
    from sglang_ext.config import QuadsConfig

    return QuadsConfig(RolloutQuantConfig(precision=mode, activation_scaling=scaling,
                                     rac_channels=16 if mode == "w4a4_rac" else 0))


def check_qkv(rank: int, x: torch.Tensor) -> None:
    """Column parallel: this rank holds rows [rank*n/2, (rank+1)*n/2) of q, k and v."""
    from sglang.srt.layers.linear import QKVParallelLinear
    from quads_megatron.kernels import reference

    cfg = config("w4a4_rac")
    layer = QKVParallelLinear(64, 16, 4, 2, bias=False, params_dtype=torch.bfloat16,
                              quant_config=cfg, prefix="qkv")
    full = {sid: {**nvfp4_linear(n, 64, i), "input_scale": input_scale(i),
                  "input_comp_index": torch.arange(0, 64, 4, dtype=torch.int32)}
            for i, (sid, n) in enumerate((("q", 64), ("k", 32), ("v", 32)))}
    for sid, tensors in full.items():
        for name, t in tensors.items():
            p = getattr(layer, name)
            p.weight_loader(p, t, sid)
    layer.quant_method.process_weights_after_loading(layer)
    static = torch.stack([t["input_scale"] for t in full.values()]).max()
    want = []
    for t in full.values():
        rows = slice(rank * t["weight"].shape[0] // TP, (rank + 1) * t["weight"].shape[0] // TP)
        want.append(reference.w4a4_linear(x, t["weight"][rows], t["weight_scale"][rows],
                                          t["weight_scale_2"], act_mode="w4a4_rac",
                                          comp_index=t["input_comp_index"], input_scale=static))
    torch.testing.assert_close(layer(x)[0], torch.cat(want, -1), rtol=0, atol=0)


def check_row(rank: int, x: torch.Tensor) -> None:
    """Row parallel: this rank holds input columns [rank*K/2, ...); the output is all-reduced."""
    from sglang.srt.layers.linear import RowParallelLinear
    from quads_megatron.kernels import reference

    try:
        RowParallelLinear(64, 32, bias=False, params_dtype=torch.bfloat16,
                          quant_config=config("w4a4_rac"), prefix="o_proj")
        raise AssertionError("RAC on a TP-sharded row-parallel layer should be refused")
    except ConfigError as e:
        assert "row-parallel" in str(e), e
    layer = RowParallelLinear(64, 32, bias=False, params_dtype=torch.bfloat16,
                              quant_config=config("w4a4"), prefix="o_proj")
    t = {**nvfp4_linear(32, 64, 9), "input_scale": input_scale(9)}
    for name, v in t.items():
        p = getattr(layer, name)
        p.weight_loader(p, v)
    layer.quant_method.process_weights_after_loading(layer)
    parts = []
    for r in range(TP):
        cols, scols = slice(r * 16, (r + 1) * 16), slice(r * 2, (r + 1) * 2)
        parts.append(reference.w4a4_linear(x[:, r * 32:(r + 1) * 32], t["weight"][:, cols],
                                           t["weight_scale"][:, scols], t["weight_scale_2"],
                                           act_mode="w4a4", input_scale=t["input_scale"]))
    want = (parts[0].float() + parts[1].float()).to(torch.bfloat16)
    torch.testing.assert_close(layer(x[:, rank * 32:(rank + 1) * 32])[0], want, rtol=1.6e-2, atol=1e-2)


def check_moe(rank: int, x: torch.Tensor) -> None:
    """Expert TP: gate/up rows and down columns of every expert are split across the ranks."""
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from quads_megatron.kernels import reference

    e, h, f = 4, 64, 64
    try:
        FusedMoE(num_experts=e, hidden_size=h, intermediate_size=f, layer_id=0, top_k=2,
                 params_dtype=torch.bfloat16, quant_config=config("w4a4_rac"), prefix="experts")
        raise AssertionError("RAC with expert tensor parallelism should be refused")
    except ConfigError as err:
        assert "--ep-size" in str(err), err
    layer = FusedMoE(num_experts=e, hidden_size=h, intermediate_size=f, layer_id=0, top_k=2,
                     params_dtype=torch.bfloat16, quant_config=config("w4a4"), prefix="experts")
    ck = {}
    for ex in range(e):
        gate, up = nvfp4_gate_up(f, h, 40 + ex)
        for proj, t in (("gate_proj", gate), ("up_proj", up), ("down_proj", nvfp4_linear(h, f, 60 + ex))):
            ck.update({f"experts.{ex}.{proj}.{k}": v for k, v in t.items()})
            ck[f"experts.{ex}.{proj}.input_scale"] = input_scale(ex)
    load_experts(layer, ck, e)
    layer.quant_method.process_weights_after_loading(layer)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(x.shape[0], e, generator=g)
    w, ids = torch.topk(torch.softmax(logits, -1), 2, dim=-1)
    topk = StandardTopKOutput(w, ids.to(torch.int32), logits)
    fl = f // TP
    rows, srows = slice(rank * fl, (rank + 1) * fl), slice(rank * fl // 16, (rank + 1) * fl // 16)

    def stack(key, proj, sl=None, dim=0):
        return torch.stack([ck[f"experts.{i}.{proj}.{key}"] if sl is None else
                            ck[f"experts.{i}.{proj}.{key}"].narrow(dim, sl.start, sl.stop - sl.start)
                            for i in range(e)])

    w13 = torch.cat([stack("weight", "gate_proj", rows), stack("weight", "up_proj", rows)], 1)
    s13 = torch.cat([stack("weight_scale", "gate_proj", rows), stack("weight_scale", "up_proj", rows)], 1)
    cols = slice(rank * fl // 2, (rank + 1) * fl // 2)
    want = reference.w4a4_fused_moe(
        x, w13, s13, stack("weight_scale_2", "gate_proj"), stack("weight", "down_proj", cols, 1),
        stack("weight_scale", "down_proj", srows, 1), stack("weight_scale_2", "down_proj"),
        topk.topk_weights, topk.topk_ids, act_mode="w4a4",
        w13_input_scale=stack("input_scale", "gate_proj").max(),
        w2_input_scale=stack("input_scale", "down_proj").max())
    torch.testing.assert_close(layer(x, topk), want, rtol=0, atol=0)  # the partial sum of this rank


def check_ep(rank: int, x: torch.Tensor) -> None:
    """Expert parallelism with RAC: this rank computes its 2 experts' share of every token."""
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from quads_megatron.kernels import reference

    e, h, f = 4, 64, 32
    layer = FusedMoE(num_experts=e, hidden_size=h, intermediate_size=f, layer_id=0, top_k=2,
                     params_dtype=torch.bfloat16, quant_config=config("w4a4_rac", "per_token"),
                     prefix="experts")
    assert layer.num_local_experts == e // TP
    fc1 = comp_index(h, 16, 7)
    ck = {}
    for ex in range(e):
        gate, up = nvfp4_gate_up(f, h, 70 + ex)
        for proj, t in (("gate_proj", gate), ("up_proj", up), ("down_proj", nvfp4_linear(h, f, 80 + ex))):
            ck.update({f"experts.{ex}.{proj}.{k}": v for k, v in t.items()})
            ck[f"experts.{ex}.{proj}.input_scale"] = input_scale(ex)
            ck[f"experts.{ex}.{proj}.input_comp_index"] = (
                comp_index(f, 16, 90 + ex) if proj == "down_proj" else fc1)
    load_experts(layer, ck, e)
    layer.quant_method.process_weights_after_loading(layer)
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(x.shape[0], e, generator=g)
    w, ids = torch.topk(torch.softmax(logits, -1), 2, dim=-1)
    ids = ids.to(torch.int32)
    owned = (ids >= rank * (e // TP)) & (ids < (rank + 1) * (e // TP))

    def stack(key, projs):
        return torch.stack([torch.cat([ck[f"experts.{i}.{p}.{key}"] for p in projs]) for i in range(e)])

    want = reference.w4a4_fused_moe(
        x, stack("weight", ["gate_proj", "up_proj"]), stack("weight_scale", ["gate_proj", "up_proj"]),
        torch.stack([ck[f"experts.{i}.gate_proj.weight_scale_2"] for i in range(e)]),
        stack("weight", ["down_proj"]), stack("weight_scale", ["down_proj"]),
        torch.stack([ck[f"experts.{i}.down_proj.weight_scale_2"] for i in range(e)]),
        w * owned, ids, act_mode="w4a4_rac", w13_comp_index=fc1,
        w2_comp_index=torch.stack([ck[f"experts.{i}.down_proj.input_comp_index"] for i in range(e)]))
    # SGLang's standard dispatcher allocates its expert map on an accelerator (none here), so
    # the ids go through its own mapping function by hand, then into the method's apply
    from sglang.srt.layers.moe.token_dispatcher.standard import (StandardDispatchOutput,
                                                                 _map_topk_ids_to_local_experts)

    local_map = torch.full((e,), -1, dtype=torch.int32)
    local_map[rank * (e // TP):(rank + 1) * (e // TP)] = torch.arange(e // TP, dtype=torch.int32)
    local_ids = _map_topk_ids_to_local_experts(ids, local_map)
    assert bool((local_ids == -1).any()), "routing should send some tokens to the other rank"
    out = layer.quant_method.apply(layer, StandardDispatchOutput(
        x, None, StandardTopKOutput(w, local_ids, logits)))
    torch.testing.assert_close(out.hidden_states, want, rtol=0, atol=0)


def main() -> None:
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    os.environ.setdefault("QUADS_BACKEND", "torch")
    init(rank, port)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    check_qkv(rank, x)
    check_row(rank, x)
    check_moe(rank, x)
    init_ep(rank)
    check_ep(rank, x)
    print(f"rank {rank}: ok")


if __name__ == "__main__":
    main()
