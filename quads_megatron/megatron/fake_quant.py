"""TP/EP-consistent NVFP4 fake quantization of Megatron weights (cached per optimizer step) and expert inputs.

The numbers come only from ``quads_megatron.nvfp4`` (or TE through ``te_bridge``); this module
adds what parallelism needs: the global amax of a sharded weight is the local amax all-reduced
with MAX over the layer's (expert-)tensor-parallel group, so a gathered fake-quantized shard is
bit-identical to ``dequantize(quantize(full_weight))``.
"""

import torch
import torch.distributed as dist

from quads_megatron import nvfp4

# How a Megatron weight tensor maps onto NVFP4 rows [.., N, K] (K = GEMM reduction dim, last).
LAYOUTS = ("linear", "grouped_fc1", "grouped_fc2")


class _StraightThrough(torch.autograd.Function):
    """Forward: the precomputed fake-quantized value; backward: the gradient, unchanged, to the master weight."""

    @staticmethod
    def forward(ctx, weight, value):
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def group_size(group) -> int:
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def all_reduce_max(t: torch.Tensor, group) -> torch.Tensor:
    """In-place MAX all-reduce over ``group`` (no-op for a group of one)."""
    if group_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


class WeightFakeQuant:
    """NVFP4 fake quantization of one weight (or a GroupedMLP expert stack) with a per-step cache.

    ``layout``: ``linear`` for a [N, K] Megatron linear weight (or a stacked [E, N, K] one);
    ``grouped_fc1`` / ``grouped_fc2``
    for GroupedMLP's ``weight1`` ([H, E*N], expert e = memory chunk e viewed [H, N]) and
    ``weight2`` ([E*F, H], expert e = [F, H]), i.e. transposed per-expert matrices.  Each expert
    (each 2-D linear) gets one global scale from its amax MAX-reduced over ``group``.
    The cache key is the weight's ``(_version, data_ptr, dtype)``: a torch optimizer's in-place
    update of the Parameter bumps ``_version``.  Megatron's mixed-precision and distributed
    optimizers write through ``param.data`` / the DDP param buffer, which does NOT bump it, so
    ``invalidate()`` (``aqat.post_optimizer_hook``) must run after every optimizer step.
    """

    def __init__(self, name, weight, *, layout="linear", num_experts=1, block_shape=(1, 16),
                 group=None, backend="torch", cache=True):
        if layout not in LAYOUTS:
            raise ValueError(f"{name}: unknown weight layout {layout!r}; expected {LAYOUTS}")
        self.name, self.layout, self.num_experts = name, layout, num_experts
        self.block_shape, self.group, self.backend, self.cache = tuple(block_shape), group, backend, cache
        self._key, self._value = None, None
        n, k = self._to_rows(weight.detach()).shape[-2:]
        self._check_shape(n, k)

    def _check_shape(self, n, k):
        ranks = group_size(self.group)
        if k % 16:
            raise ValueError(
                f"{self.name}: per-rank reduction dim K={k} (over {ranks} rank(s) of its tensor-"
                f"parallel group) is not a multiple of 16, so NVFP4 16-element blocks would "
                f"straddle the shard boundary; choose a hidden/FFN size with K per rank % 16 == 0")
        if self.block_shape == (16, 16) and n % 16:
            raise ValueError(
                f"{self.name}: per-rank output dim N={n} (over {ranks} rank(s)) is not a multiple "
                f"of 16, so 16x16 NVFP4 tiles would straddle the shard boundary")

    # -- layouts ---------------------------------------------------------------------------
    def _to_rows(self, w):
        if self.layout == "linear":
            return w
        e = self.num_experts
        if self.layout == "grouped_fc1":
            return w.view(e, w.shape[0], -1).transpose(1, 2)   # [E, N, H]
        return w.view(e, -1, w.shape[1]).transpose(1, 2)        # [E, H, F]

    def _from_rows(self, rows, like):
        if self.layout == "linear":
            return rows
        return rows.transpose(1, 2).contiguous().view(like.shape)

    # -- numbers ---------------------------------------------------------------------------
    def global_amax(self, weight) -> torch.Tensor:
        """Amax of each whole logical matrix (scalar, or [E, 1, 1] for an expert stack)."""
        rows = self._to_rows(weight.detach())
        if rows.ndim == 2:
            amax = nvfp4.amax_of(rows)
        else:  # max|x| per expert in one read (no |x| temporary); exact, like amax_of
            amax = torch.linalg.vector_norm(rows, ord=float("inf"), dim=(-2, -1), keepdim=True,
                                            dtype=torch.float32)
        return all_reduce_max(amax.contiguous(), self.group)

    def compute(self, weight) -> torch.Tensor:
        """The fake-quantized weight (detached, same shape/dtype as ``weight``), uncached."""
        # A normal tensor even under torch.inference_mode (rollout log-probs), so that the
        # cached value can serve the next training forward.
        with torch.inference_mode(False), torch.no_grad():
            return self._compute(weight)

    def _compute(self, weight):
        rows = self._to_rows(weight.detach())
        if self.backend == "te":
            from quads_megatron.megatron import te_bridge

            group = self.group if group_size(self.group) > 1 else None
            mats = rows if rows.ndim == 3 else rows.unsqueeze(0)
            out = torch.stack([te_bridge.te_fake_quantize(m, self.block_shape, group) for m in mats])
            out = out if rows.ndim == 3 else out[0]
        elif rows.ndim == 3 and self.block_shape == (1, 16):  # an expert stack: one launch
            out = grouped_fake_quantize(rows.contiguous(), self.group)
        else:
            out = nvfp4.fake_quantize(rows, block_shape=self.block_shape,
                                      amax=self.global_amax(weight), check_finite=False)
        return self._from_rows(out, weight)

    def value(self, weight) -> torch.Tensor:
        """Cached ``compute(weight)``: recomputed only when the master weight changed."""
        if not self.cache:
            return self.compute(weight)
        key = (weight._version, weight.data_ptr(), weight.dtype)
        if self._key != key:
            self._value, self._key = self.compute(weight), key
        return self._value

    def __call__(self, weight) -> torch.Tensor:
        """The fake-quantized weight with a straight-through gradient to ``weight``."""
        return _StraightThrough.apply(weight, self.value(weight))

    def invalidate(self):
        self._key, self._value = None, None


def grouped_amax(mats, group) -> tuple:
    """(amax fp32 [E], nonfinite int32 [E]) of E expert matrices, one read; MAX-reduced over a group of several
    ranks (the amax of a sharded weight is the full weight's)."""
    amax, bad = nvfp4.amax_grouped(mats)
    if group_size(group) <= 1:
        return amax, bad
    both = all_reduce_max(torch.cat([amax, bad.to(torch.float32)]), group)
    n = amax.numel()
    return both[:n], (both[n:] > 0).to(torch.int32)


def grouped_fake_quantize(mats, group, out=None) -> torch.Tensor:
    """Fake-quantized [E, N, K] of E expert matrices (a stack or a list), one global scale each.

    The amax pass and the fake-quant pass (two launches); with a (expert-)TP group of several ranks the
    per-expert amax (and NaN/Inf flags) are MAX-reduced between them, so every rank uses the full weight's scale."""
    if group_size(group) <= 1:
        return nvfp4.fake_quantize_grouped(mats, out=out)
    amax, bad = grouped_amax(mats, group)
    return nvfp4.fake_quantize_grouped(mats, amax=amax, nonfinite=bad, out=out)


class ExpertsFakeQuant:
    """One per-step cache for the same weight of all local experts of a layer (fc1 or fc2 of a Megatron
    ``SequentialMLP`` / TE ``GroupedLinear``), refreshed for all experts in one launch.

    The weights stay separate Parameters (read through a pointer table, no stacking copy); the cache is
    one [E, N, K] tensor and ``expert(i)`` is what expert i's module reads. The first expert whose
    master weight changed (``_version`` / ``data_ptr``, or ``invalidate()`` after an optimizer step)
    refreshes them all. The per-expert amax (``amax()``: one read of the weights, MAX-reduced over the
    group) is cached on its own for the same weight version: the refit's NVFP4 build of the rollout
    weights reads it (``iter_hf_weights(stacked_experts=True)``) and the refresh reuses it, so one amax
    pass per optimizer step serves both. Each weight Parameter points back here (``QUADS_EXPERTS_ATTR``).
    """

    def __init__(self, name, weights, *, group=None):
        self.name, self.weights, self.group = name, list(weights), group
        n, k = self.weights[0].shape
        if k % 16:
            raise ValueError(f"{name}: per-rank reduction dim K={k} (over {group_size(group)} rank(s) of its "
                             f"tensor-parallel group) is not a multiple of 16 (NVFP4 blocks)")
        self._keys, self._value = None, None
        self._amax_keys, self._amax = None, None
        for i, w in enumerate(self.weights):
            setattr(w, QUADS_EXPERTS_ATTR, (self, i))

    @staticmethod
    def _key(w):
        return (w._version, w.data_ptr(), w.dtype)

    def amax(self) -> tuple:
        """(amax fp32 [E], nonfinite int32 [E]) of the current weights, MAX-reduced over the group; cached
        until a weight changes or ``invalidate()`` (one read of the weights per optimizer step)."""
        keys = [self._key(w) for w in self.weights]
        if self._amax is None or self._amax_keys != keys:
            with torch.inference_mode(False), torch.no_grad():
                self._amax = grouped_amax(self.weights, self.group)
            self._amax_keys = keys
        return self._amax

    def refresh(self) -> torch.Tensor:
        """Fake-quantize every expert now: one launch with the cached amax (two without); no autograd,
        valid under inference_mode too."""
        amax, bad = self.amax()
        with torch.inference_mode(False), torch.no_grad():
            # a fresh buffer: the previous step's value may still be saved for a backward
            self._value = nvfp4.fake_quantize_grouped(self.weights, amax=amax, nonfinite=bad, name=self.name)
        self._keys = [self._key(w) for w in self.weights]
        return self._value

    def adopt(self, value: torch.Tensor) -> None:
        """Take ``value`` ([E, N, K], the fake quantization of the current weights with ``amax()``, built
        elsewhere from the same read: the refit's ``nvfp4.refit_grouped``) as this step's cache. An inference
        tensor (built under ``torch.inference_mode``) cannot serve a backward: it is left, the refresh runs."""
        if value.is_inference():
            return
        if self._amax is None or tuple(value.shape) != (len(self.weights), *self.weights[0].shape):
            raise ValueError(f"{self.name}: adopt needs the fake quantization of the cached amax's weights, "
                             f"[{len(self.weights)}, {', '.join(map(str, self.weights[0].shape))}], "
                             f"got {tuple(value.shape)}")
        self._value, self._keys = value, list(self._amax_keys)

    def value(self, i: int) -> torch.Tensor:
        if self._keys is None or self._keys[i] != self._key(self.weights[i]):
            self.refresh()
        return self._value[i]

    def invalidate(self):
        self._keys = None
        self._amax_keys, self._amax = None, None

    def expert(self, i: int) -> "ExpertFakeQuant":
        return ExpertFakeQuant(self, i)


QUADS_EXPERTS_ATTR = "_quads_experts_fake_quant"
"""Attribute set on every expert weight Parameter an ``ExpertsFakeQuant`` covers: (that cache, index)."""


def experts_cache_of(params) -> "ExpertsFakeQuant | None":
    """The ``ExpertsFakeQuant`` covering exactly these expert weight Parameters, in their order, or None."""
    found = [getattr(p, QUADS_EXPERTS_ATTR, None) for p in params]
    if not found or any(f is None for f in found):
        return None
    owner = found[0][0]
    if any(f[0] is not owner for f in found) or [f[1] for f in found] != list(range(len(owner.weights))):
        return None
    return owner


class ExpertFakeQuant:
    """Expert i's view of an ``ExpertsFakeQuant``: the ``WeightFakeQuant`` interface for one weight."""

    def __init__(self, shared: ExpertsFakeQuant, index: int):
        self.shared, self.index, self.group = shared, index, shared.group
        self.name = f"{shared.name}[{index}]"

    def global_amax(self, weight) -> torch.Tensor:
        """This expert's amax MAX-reduced over its (expert-)TP group: what its global scale comes from."""
        return all_reduce_max(nvfp4.amax_of(weight.detach()).contiguous(), self.group)

    def value(self, weight) -> torch.Tensor:
        return self.shared.value(self.index)

    def compute(self, weight) -> torch.Tensor:
        return self.shared.refresh()[self.index]

    def __call__(self, weight) -> torch.Tensor:
        return _StraightThrough.apply(weight, self.value(weight))

    def invalidate(self):
        self.shared.invalidate()


def fake_quantize_activation(x: torch.Tensor, scaling: str, group=None,
                             k_sharded: bool = False) -> torch.Tensor:
    """NVFP4 fake quant (straight-through) of a GEMM input, per token or per tensor.

    The amax is MAX-reduced over ``group`` when the input's K is sharded across it
    (row-parallel inputs), and for per-tensor scaling (tokens may be sequence-sharded).
    """
    if x.numel() == 0:
        return x
    if x.shape[-1] % 16:
        raise ValueError(f"activation of shape {tuple(x.shape)}: K={x.shape[-1]} is not a "
                         f"multiple of 16 (NVFP4 blocks)")
    if scaling == "per_token":
        amax = nvfp4.amax_of(x.detach(), per_row=True).contiguous()
        if k_sharded:
            all_reduce_max(amax, group)
        return nvfp4.fake_quantize(x, per_row=True, amax=amax, check_finite=False)
    if scaling == "static":  # training has no calibration: the batch's per-tensor amax
        amax = all_reduce_max(nvfp4.amax_of(x.detach()).contiguous(), group)
        return nvfp4.fake_quantize(x, amax=amax, check_finite=False)
    raise ValueError(f"unknown activation scaling {scaling!r}; expected 'per_token' or 'static'")
