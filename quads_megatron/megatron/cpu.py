"""Run Megatron-Core (0.16.1, 0.19.x) MoE GPT models on CPU with gloo, by patching its CUDA-only calls.

Megatron-Core assumes CUDA in a handful of places (each patch below names the call it
replaces).  ``setup_megatron_cpu()`` patches exactly those, and only when
``torch.cuda.is_available()`` is False (the CUDA build of torch on a CPU machine counts as no
CUDA).  It is idempotent and a no-op on a GPU machine, so tests, examples and CPU users can all
call it unconditionally before building a model.

What it patches (numbers as in the notes):
 1. ``torch.cuda.current_device()`` -> ``torch.device("cpu")`` (~175 call sites allocate on it).
 2. ``torch.cuda.synchronize()`` -> no-op (dist_checkpointing writer);
    ``torch.cuda.current_stream()`` -> a dummy stream (0.19.x DDP grad sync).
 3. The RNG tracker's CUDA state get/set/add -> the CPU generator, so
    ``model_parallel_cuda_manual_seed`` and ``tracker.fork()`` (always entered by attention) work.
 4. The alltoall token dispatcher's CUDA side stream / device-to-host copies -> numpy splits.
 5. 0.16.1 without Transformer Engine leaves ``moe_utils.te_general_gemm`` undefined -> None.
 6. Without Apex, ``WrappedTorchNorm`` refuses sequence parallelism (which MoE + TP needs) ->
    plain ``torch.nn.RMSNorm``/``LayerNorm`` whose params are tagged ``sequence_parallel`` so
    ``finalize_model_grads`` (or ``parallel.sync_grads``) all-reduces their grads over TP.
 6b. ``get_default_causal_mask`` (used when ``attention_mask=None``) allocates on "cuda" -> CPU.
 7. Megatron's optimizer and clip-grad code use literal ``device='cuda'`` tensors and assert
    ``torch.cuda.FloatTensor`` grads -> ``cuda_to_cpu()``, a TorchFunctionMode to wrap around
    optimizer creation, ``step()`` and checkpoint save/load.
 8. ``grouped_gemm_shim=True``: the legacy ``GroupedMLP`` needs the CUDA-only ``grouped_gemm``
    package -> a loop of matmuls (``gmm``), so GroupedMLP models can be exercised on CPU.

``cpu_config_overrides()`` returns the ``TransformerConfig`` fields that must be set on CPU
(no fused kernels, CPU initialisation); ``presets.qwen3_moe_config`` applies them by itself.
"""

import contextlib
import types

import torch
from torch.overrides import TorchFunctionMode

_APPLIED = {"base": False, "grouped_gemm": False}


def cuda_usable() -> bool:
    """True when a CUDA device can actually run kernels (the CUDA build on a CPU box is False)."""
    return torch.cuda.is_available()


def cpu_config_overrides() -> dict:
    """TransformerConfig fields that Megatron-Core needs on CPU (no fused CUDA kernels)."""
    return dict(
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        bias_dropout_fusion=False,
    )


class _NoStream:
    """Stand-in for a CUDA stream/event on CPU: every wait/sync is immediate."""

    def wait_event(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def record_event(self, *args, **kwargs):
        return self


def _patch_torch_cuda():
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_stream = lambda *args, **kwargs: _NoStream()


def _patch_rng_tracker():
    import megatron.core.tensor_parallel.random as mrandom

    def _cpu_add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, *args, **kwargs: torch.set_rng_state(new_state)
    mrandom.CudaRNGStatesTracker.add = _cpu_add


def _patch_alltoall_dispatcher():
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    # A non-None class attribute stops __init__ from creating a torch.cuda.Stream().
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NoStream()

    def _cpu_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        """CPU version: the 'device-to-host' copy only turns split sizes into numpy."""
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(self, name, None)
                if torch.is_tensor(value):
                    setattr(self, name, value.numpy())
        return tokens_per_expert

    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _cpu_dtoh_and_synchronize


def _patch_moe_utils():
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _patch_torch_norm():
    import megatron.core.transformer.torch_norm as torch_norm

    def _norm_new(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False,
                  zero_centered_gamma=False, normalization="LayerNorm"):
        """torch LayerNorm/RMSNorm that also works on a sequence-parallel shard (per-token op)."""
        if config.layernorm_zero_centered_gamma:
            raise ValueError("zero-centered gamma is not supported by torch norms (CPU fallback)")
        norm_cls = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}.get(
            config.normalization)
        if norm_cls is None:
            raise ValueError(f"CPU norm fallback supports LayerNorm/RMSNorm, "
                             f"not {config.normalization!r}")
        module = norm_cls(normalized_shape=hidden_size, eps=eps, dtype=config.params_dtype)
        for param in module.parameters():
            param.sequence_parallel = config.sequence_parallel
        return module

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(_norm_new)


def _patch_causal_mask():
    import functools

    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.transformer.utils as transformer_utils

    @functools.lru_cache(maxsize=None)
    def get_default_causal_mask(sq: int) -> torch.Tensor:
        """CPU causal upper-triangular mask (True = masked) for attention_mask=None (cached)."""
        with torch.inference_mode(False):  # cached: must stay usable outside inference mode
            return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    transformer_utils.get_default_causal_mask = get_default_causal_mask
    fused_softmax.get_default_causal_mask = get_default_causal_mask


def _patch_grouped_gemm():
    try:
        import megatron.core.transformer.moe.grouped_gemm_util as gg
    except ImportError:  # megatron-core >= 0.19 has no legacy GroupedMLP to shim
        return

    if gg.grouped_gemm_is_available():
        return

    def gmm(a, b, batch_sizes, trans_b=False):
        """Grouped GEMM as a loop of matmuls: rows of ``a`` grouped by ``batch_sizes``."""
        outs, start = [], 0
        for i, n in enumerate(batch_sizes.tolist()):
            outs.append(a[start:start + n] @ (b[i].t() if trans_b else b[i]))
            start += n
        return torch.cat(outs) if outs else a.new_zeros(0, b.shape[-2 if trans_b else -1])

    gg.grouped_gemm = types.SimpleNamespace(ops=types.SimpleNamespace(gmm=gmm))
    gg.ops = gg.grouped_gemm.ops


def _apex_available() -> bool:
    try:
        import apex  # noqa: F401
        from apex.normalization import FusedLayerNorm  # noqa: F401  (PyPI's unrelated "apex" has none)
    except ImportError:
        return False
    return True


def setup_megatron_cpu(grouped_gemm_shim: bool = False) -> bool:
    """Patch Megatron-Core for CPU execution when CUDA is unusable; returns True if patched.

    On a GPU only patch 6 applies, and only without Apex: Megatron's local spec then falls back to
    ``WrappedTorchNorm``, which refuses the sequence parallelism that MoE + TP needs on any device.
    """
    if cuda_usable():
        if not _apex_available() and not _APPLIED.get("norm"):
            _patch_torch_norm()
            _APPLIED["norm"] = True
        return False
    if not _APPLIED["base"]:
        _patch_torch_cuda()
        _patch_rng_tracker()
        _patch_alltoall_dispatcher()
        _patch_moe_utils()
        _patch_torch_norm()
        _patch_causal_mask()
        _APPLIED["base"] = True
    if grouped_gemm_shim and not _APPLIED["grouped_gemm"]:
        _patch_grouped_gemm()
        _APPLIED["grouped_gemm"] = True
    return True


class CudaToCpuMode(TorchFunctionMode):
    """Maps ``device='cuda'`` tensor creation, ``.cuda()`` and cuda type checks onto the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        device = kwargs.get("device")
        if (isinstance(device, str) and device.startswith("cuda")) or (
                isinstance(device, torch.device) and device.type == "cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def cuda_to_cpu():
    """Context for Megatron optimizer/checkpoint calls: CudaToCpuMode on CPU, nothing on GPU."""
    return CudaToCpuMode() if not cuda_usable() else contextlib.nullcontext()
