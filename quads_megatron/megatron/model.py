"""Build a Megatron-Core GPTModel with Megatron's own MoE layer specs (local or TE) and per-expert seeded init."""

import hashlib

import torch

from quads_megatron.device import default_device
from quads_megatron.megatron import cpu
from quads_megatron.megatron.parallel import initialize_distributed  # noqa: F401  (re-export)

SPECS = ("local", "te")


def transformer_engine_available() -> bool:
    """True when transformer_engine.pytorch imports (never on the CPU CI machines)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA install raising at import
        return False
    return True


def layer_spec(config, spec: str = "local", moe_grouped_gemm=None):
    """Megatron's GPT layer spec for ``config``: 'local' (SequentialMLP/GroupedMLP) or 'te' (TEGroupedMLP)."""
    from megatron.core.models.gpt import gpt_layer_specs

    grouped = config.moe_grouped_gemm if moe_grouped_gemm is None else moe_grouped_gemm
    if spec == "local":
        return gpt_layer_specs.get_gpt_layer_local_spec(
            num_experts=config.num_moe_experts, moe_grouped_gemm=grouped,
            qk_layernorm=config.qk_layernorm, normalization=config.normalization)
    if spec == "te":
        if not transformer_engine_available():
            raise RuntimeError("spec='te' needs transformer_engine (pip install "
                               "'transformer-engine[pytorch]' on a CUDA machine); use spec='local'")
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=config.num_moe_experts, moe_grouped_gemm=grouped,
            qk_layernorm=config.qk_layernorm)
    raise ValueError(f"unknown layer spec {spec!r}; expected one of {SPECS}")


def build_gpt_model(config, vocab_size: int, max_seq_len: int, *, spec: str = "local",
                    rotary_base: float = 1_000_000, expert_seed=1234,
                    share_embeddings_and_output_weights: bool = False,
                    pre_process: bool = True, post_process: bool = True, parallel_output: bool = True):
    """Megatron-Core GPTModel (RoPE) with the local spec by default, the TE spec when asked for.

    Needs ``initialize_distributed`` (parallel_state) first.  With ``expert_seed`` (default) the
    model is re-initialised layout-independently: each routed expert from a seed of its own
    (layer, global expert index), every other matrix from a seed of its (global) name, the full
    logical weight generated with Megatron's init method and then sliced for this rank's shard.
    So experts differ across EP ranks and the model is the same for every TP/EP layout.
    The model ends on ``quads_megatron.device.default_device()`` (this rank's GPU, or the CPU).
    ``expert_seed=None`` keeps Megatron's initialisation.
    """
    from megatron.core.models.gpt.gpt_model import GPTModel

    if config.moe_grouped_gemm and spec == "local":
        cpu.setup_megatron_cpu(grouped_gemm_shim=True)
    model = GPTModel(
        config=config, transformer_layer_spec=layer_spec(config, spec), vocab_size=vocab_size,
        max_sequence_length=max_seq_len, pre_process=pre_process, post_process=post_process,
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
        position_embedding_type="rope", rotary_base=rotary_base)
    if expert_seed is not None:
        init_dense_layout_independent(model, expert_seed)
        if config.num_moe_experts:
            init_experts_per_expert(model, expert_seed)
    # Megatron builds its linears on the current CUDA device, but torch norms (no Apex/TE) on the CPU:
    # one move puts every parameter and buffer on this rank's device.
    return model.to(default_device())


def _expert_seed(seed: int, layer_number: int, expert: int, which: str) -> int:
    digest = hashlib.sha256(f"{seed}/{layer_number}/{expert}/{which}".encode()).digest()
    return int.from_bytes(digest[:7], "little")


def _full_expert_weight(init_method, shape, dtype, seed):
    """Generate one logical (unsharded) weight with Megatron's init_method under a private seed."""
    full = torch.empty(shape, dtype=torch.float32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        init_method(full)
    return full.to(dtype)


@torch.no_grad()
def init_dense_layout_independent(model, seed: int):
    """Re-initialise non-expert matrices (embedding, attention, router, dense MLP, output) per global name."""
    from megatron.core import parallel_state

    config = model.config
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    local_to_global = {f"decoder.layers.{i}.": f"decoder.layers.{layer.layer_number - 1}."
                       for i, layer in enumerate(getattr(model.decoder, "layers", []))}
    for name, param in model.named_parameters():
        if param.dim() < 2 or ".mlp.experts." in f".{name}":  # norms; routed experts
            continue
        key = name
        for local, global_ in local_to_global.items():
            if name.startswith(local):
                key = global_ + name[len(local):]
                break
        scaled = name.endswith(("linear_proj.weight", "linear_fc2.weight"))
        init_method = config.output_layer_init_method if scaled else config.init_method
        shape = list(param.shape)
        sharded = getattr(param, "tensor_model_parallel", False) and tp_size > 1
        if sharded:
            shape[param.partition_dim] *= tp_size
        full = _full_expert_weight(init_method, tuple(shape), param.dtype,
                                   _expert_seed(seed, 0, 0, key))
        if sharded:  # Megatron's strided split (stride 2: [gate_r; up_r] of a SwiGLU fc1)
            stride = getattr(param, "partition_stride", 1)
            parts = full.chunk(tp_size * stride, dim=param.partition_dim)
            full = torch.cat(parts[tp_rank::tp_size], dim=param.partition_dim)
        param.copy_(full)


def expert_shards(full_fc1, full_fc2, etp_rank: int, etp_size: int):
    """This expert-TP rank's slice of a logical fc1 [gate; up] ([2F, H]) and fc2 ([H, F])."""
    gate, up = full_fc1.chunk(2, dim=0)
    fc1 = torch.cat([gate.chunk(etp_size, dim=0)[etp_rank], up.chunk(etp_size, dim=0)[etp_rank]])
    fc2 = full_fc2.chunk(etp_size, dim=1)[etp_rank]
    return fc1, fc2


@torch.no_grad()
def init_experts_per_expert(model, seed: int):
    """Re-initialise every routed expert from its own seed (SequentialMLP, GroupedMLP, TEGroupedMLP)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import experts as moe_experts

    SequentialMLP = moe_experts.SequentialMLP
    GroupedMLP = getattr(moe_experts, "GroupedMLP", ())  # legacy; gone in megatron-core 0.19

    config = model.config
    if not config.gated_linear_unit:
        raise ValueError("init_experts_per_expert expects SwiGLU experts (gated_linear_unit=True)")
    etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    etp_size = parallel_state.get_expert_tensor_parallel_world_size()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    H, F = config.hidden_size, config.moe_ffn_hidden_size
    for layer in model.decoder.layers:
        experts = getattr(getattr(layer, "mlp", None), "experts", None)
        if experts is None:
            continue
        n_local = experts.num_local_experts
        for local in range(n_local):
            expert = ep_rank * n_local + local
            fc1 = _full_expert_weight(config.init_method, (2 * F, H), config.params_dtype,
                                      _expert_seed(seed, layer.layer_number, expert, "fc1"))
            fc2 = _full_expert_weight(config.output_layer_init_method, (H, F), config.params_dtype,
                                      _expert_seed(seed, layer.layer_number, expert, "fc2"))
            fc1, fc2 = expert_shards(fc1, fc2, etp_rank, etp_size)
            if isinstance(experts, SequentialMLP):
                experts.local_experts[local].linear_fc1.weight.copy_(fc1)
                experts.local_experts[local].linear_fc2.weight.copy_(fc2)
            elif isinstance(experts, GroupedMLP):
                experts.weight1.view(n_local, H, -1)[local].copy_(fc1.t())
                experts.weight2.view(n_local, -1, H)[local].copy_(fc2.t())
            elif hasattr(experts, "linear_fc1") and hasattr(experts.linear_fc1, f"weight{local}"):
                # TEGroupedMLP: TE GroupedLinear keeps one weight{i} [out, in] per local expert.
                getattr(experts.linear_fc1, f"weight{local}").copy_(fc1)
                getattr(experts.linear_fc2, f"weight{local}").copy_(fc2)
            else:
                raise TypeError(f"init_experts_per_expert: {type(experts).__name__} in layer "
                                f"{layer.layer_number} is not SequentialMLP/GroupedMLP; "
                                "pass expert_seed=None to keep Megatron's initialisation")
