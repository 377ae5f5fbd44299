"""The local engine keeps the RAC weight columns Wq[:, S] current across in-place weight loads and calibrations.

The forward runs the Triton kernels (the interpreter on CPU) against the torch reference at the
fp32-accumulation level: a stale column (old weight or old channel set) would change the RAC term.
"""

import pytest
import torch

from quads_megatron import nvfp4
from quads_megatron.rollout.modules import NVFP4Experts, NVFP4Linear
from quads_megatron.vocab import Precision
from quads_megatron.kernels import reference
from quads_megatron.kernels.gemm import interpreting
from quads_megatron.kernels.rac_columns import rac_weight_columns

pytestmark = pytest.mark.skipif(torch.cuda.is_available() or not interpreting(),
                                reason="CPU kernel tests need TRITON_INTERPRET=1 and no GPU")
E, H, F, K = 4, 64, 32, 16


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _channels(k_in, gen, groups=None):
    one = lambda: torch.sort(torch.randperm(k_in, generator=gen)[:K]).values.int()  # noqa: E731
    return one() if groups is None else torch.stack([one() for _ in range(groups)])


def _load_experts(m, gen):
    for e in range(E):
        g, u = nvfp4.quantize_with_shared_scale([torch.randn(F, H, generator=gen) * 0.1,
                                                 torch.randn(F, H, generator=gen) * 0.1])
        m.load("gate_proj", e, g)
        m.load("up_proj", e, u)
        m.load("down_proj", e, nvfp4.quantize(torch.randn(H, F, generator=gen) * 0.1))


def test_experts_columns_follow_loads_and_channels(monkeypatch):
    monkeypatch.setenv("QUADS_BACKEND", "triton")
    gen = torch.Generator().manual_seed(0)
    m = NVFP4Experts(E, H, F, Precision.W4A4_RAC, "cpu")
    _load_experts(m, gen)
    m.w13_comp_index, m.w2_comp_index = _channels(H, gen), _channels(F, gen, E)
    x = torch.randn(5, H, generator=gen)
    tw, ti = torch.topk(torch.randn(5, E, generator=gen).softmax(-1), 2)
    ti = ti.int()

    def check():
        m.refresh_rac_columns()  # what LocalEngine runs after every weight load and calibration
        out = m(x, ti, tw)
        ref = reference.w4a4_fused_moe(x, m.w13, m.w13_scale, m.w13_scale_2, m.w2, m.w2_scale, m.w2_scale_2, tw, ti,
                                       act_mode="w4a4_rac", w13_comp_index=m.w13_comp_index,
                                       w2_comp_index=m.w2_comp_index)
        assert _rel(out, ref) < 3e-6
        c13, c2 = m.w13_comp_weight, m.w2_comp_weight
        assert torch.equal(c13, rac_weight_columns(m.w13, m.w13_scale, m.w13_comp_index))
        assert torch.equal(c2, rac_weight_columns(m.w2, m.w2_scale, m.w2_comp_index))
        return c13, c2

    first = check()
    _load_experts(m, gen)  # a weight sync writes the buffers in place
    assert all(a is b for a, b in zip(check(), first))  # rebuilt into the same tensors (graph-safe)
    m.w2_comp_index.copy_(_channels(F, gen, E))  # a calibration writes the channels in place
    m.w13_comp_index = _channels(H, gen)         # ... or rebinds them
    assert all(a is b for a, b in zip(check(), first))


def test_linear_columns_follow_loads(monkeypatch):
    monkeypatch.setenv("QUADS_BACKEND", "triton")
    gen = torch.Generator().manual_seed(1)
    m = NVFP4Linear(48, H, Precision.W4A4_RAC, "cpu")
    m.comp_index = _channels(H, gen)
    x = torch.randn(3, H, generator=gen)
    for _ in range(2):
        m.load(nvfp4.quantize(torch.randn(48, H, generator=gen) * 0.1))
        m.refresh_rac_columns()
        ref = reference.w4a4_linear(x, m.weight, m.weight_scale, m.weight_scale_2, act_mode="w4a4_rac",
                                    comp_index=m.comp_index)
        assert _rel(m(x), ref) < 3e-6
        assert torch.equal(m.comp_weight, rac_weight_columns(m.weight, m.weight_scale, m.comp_index))


def test_engine_refreshes_columns_after_sync_and_calibration():
    """LocalEngine.update_weights / calibrate rebuild every module's columns, in place after the first time."""
    from test_decode import _engine, _source_weights  # noqa: E402 (this directory is on sys.path under pytest)

    eng = _engine("w4a4_rac")  # update_weights, then calibrate
    experts = eng.nvfp4_modules["model.layers.0.mlp.experts"]
    cols = experts.w13_comp_weight
    assert torch.equal(cols, rac_weight_columns(experts.w13, experts.w13_scale, experts.w13_comp_index))
    eng.update_weights(_source_weights(seed=5))  # the next step's sync writes the weights in place
    assert experts.w13_comp_weight is cols
    assert torch.equal(cols, rac_weight_columns(experts.w13, experts.w13_scale, experts.w13_comp_index))
    assert torch.equal(experts.w2_comp_weight, rac_weight_columns(experts.w2, experts.w2_scale,
                                                                  experts.w2_comp_index))
