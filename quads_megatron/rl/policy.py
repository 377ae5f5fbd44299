"""The trainer side of the loop: a Megatron-Core GPTModel, its token log-probs, optimizer and grad norm."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


class MegatronPolicy:
    """Owns the Megatron-Core model (AQAT experts when asked) and a torch AdamW on its parameters."""

    def __init__(self, args, vocab_size: int):
        """vocab_size: the HF (tokenizer-side) vocabulary; Megatron pads it for TP when needed."""
        from quads_megatron.megatron import build_gpt_model, initialize_distributed, qwen3_moe_config
        from quads_megatron.megatron.presets import qwen3_moe_model_args

        initialize_distributed(tp=args.tensor_model_parallel_size, ep=args.expert_model_parallel_size,
                               etp=args.expert_tensor_parallel_size, seed=args.seed)
        overrides = dict(tensor_model_parallel_size=args.tensor_model_parallel_size,
                         expert_model_parallel_size=args.expert_model_parallel_size,
                         # every router gets Megatron's RouterReplay: R3, and the disagreement metric
                         moe_enable_routing_replay=True)
        if args.expert_tensor_parallel_size is not None:
            overrides["expert_tensor_parallel_size"] = args.expert_tensor_parallel_size
        if args.bf16:
            overrides.update(params_dtype=torch.bfloat16, bf16=True)
        for flag, field in (("num_layers", "num_layers"), ("hidden_size", "hidden_size"),
                            ("num_experts", "num_moe_experts"), ("moe_router_topk", "moe_router_topk")):
            if getattr(args, flag, None) is not None:
                overrides[field] = getattr(args, flag)
        self.hf_ckpt = None
        tie = False
        if args.hf_checkpoint:
            from quads_megatron.models import qwen3_moe
            from quads_megatron.convert.hf_checkpoint import HFCheckpoint

            self.hf_ckpt = HFCheckpoint(args.hf_checkpoint)
            overrides.update(qwen3_moe.megatron_config_kwargs(self.hf_ckpt.config))
            self.rotary_base = qwen3_moe.rope_theta(self.hf_ckpt.config)
            dims = qwen3_moe.dims_from_hf_config(self.hf_ckpt.config)
            vocab_size, tie = dims.vocab_size, dims.tie_word_embeddings
        else:
            self.rotary_base = qwen3_moe_model_args(args.preset)["rotary_base"]
        self.config = qwen3_moe_config(args.preset, **overrides)
        from quads_megatron.convert.megatron_params import padded_vocab_size

        self.vocab_size = vocab_size  # HF rows; Megatron's extra padded rows are masked out of the softmax
        self.padded_vocab_size = padded_vocab_size(vocab_size, args.tensor_model_parallel_size)
        self.tie_word_embeddings = tie
        self.max_seq_len = args.seq_length
        self.model = build_gpt_model(self.config, self.padded_vocab_size, args.seq_length,
                                     rotary_base=self.rotary_base, expert_seed=args.seed,
                                     share_embeddings_and_output_weights=tie)
        # One recipe and its plan decide what is NVFP4 for the trainer, the sync and the rollout engine.
        from quads_megatron.megatron.aqat import apply_quads, plan_for_model, quads_plan

        self.recipe = args.recipe
        if self.recipe.train_precision.quantizes_weights:
            self.model = apply_quads(self.model, self.recipe)   # resolves the plan once
            self.plan = quads_plan(self.model)
        else:
            self.plan = plan_for_model(self.model, self.recipe)
        from quads_megatron.megatron.routing_replay import RoutingReplay

        self.routing = RoutingReplay(self.model)
        self.last_routing_diff = None  # [B, S-1, L] bool of the last token_logprobs with routes
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr, betas=(args.adam_beta1, args.adam_beta2),
                                           eps=args.adam_eps, weight_decay=args.weight_decay)
        self.device = next(self.model.parameters()).device
        self.clip_grad = args.clip_grad
        self.temperature = args.temperature if args.temperature > 0 else 1.0
        self.tp = args.tensor_model_parallel_size

    # ------------------------------------------------------------------ parallel helpers
    @staticmethod
    def dp_rank_size() -> tuple[int, int]:
        """(rank, size) in Megatron's data-parallel group: the ranks that see different samples."""
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()

    @staticmethod
    def dp_group():
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group()

    # ------------------------------------------------------------------ forward
    def _pad_len(self, n: int) -> int:
        return n if self.tp == 1 else int(math.ceil(n / self.tp) * self.tp)

    def token_logprobs(self, tokens: torch.Tensor, with_entropy: bool = False, routes: torch.Tensor | None = None,
                       replay: bool = False):
        """Log-probs [B, S-1] of tokens[:, 1:] under softmax(logits / temperature); entropy [B, S-1] optionally.

        routes: the rollout's top-k expert ids [B, S, L, K]; with them ``last_routing_diff`` [B, S-1, L] says
        where the routers' own top-k set differs, and with ``replay`` the routers use them (R3).
        """
        from megatron.core import tensor_parallel

        B, S = tokens.shape
        Sp = self._pad_len(S)
        if Sp != S:
            tokens = torch.cat([tokens, tokens.new_zeros(B, Sp - S)], 1)
            if routes is not None:  # TP padding rows: experts 0..K-1, like every row the rollout never fed
                K = routes.shape[-1]
                fill = torch.arange(K, dtype=routes.dtype).expand(B, Sp - S, routes.shape[2], K)
                routes = torch.cat([routes, fill], 1)
        tokens = tokens.to(self.device)
        pos = torch.arange(Sp, device=self.device).unsqueeze(0).expand(B, Sp)
        self.routing.begin(routes, replay, self.device)
        logits = self.model(tokens, pos, None)  # [B, Sp, V/TP]
        diff = self.routing.end(B, Sp)
        self.last_routing_diff = None if diff is None else diff[:, : S - 1]
        logits = logits[:, : S - 1].float() / self.temperature
        if self.padded_vocab_size > self.vocab_size:  # padded rows do not exist on the rollout side
            from megatron.core import parallel_state

            shard = logits.shape[-1]
            start = parallel_state.get_tensor_model_parallel_rank() * shard
            pad = torch.arange(start, start + shard, device=logits.device) >= self.vocab_size
            logits = logits.masked_fill(pad, float("-inf"))
        labels = tokens[:, 1:S]
        if self.tp == 1:
            logp_all = torch.log_softmax(logits, -1)
            logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
            ent = -torch.special.xlogy(logp_all.exp(), logp_all.exp()).sum(-1).detach() if with_entropy else None
        else:
            logp = -tensor_parallel.vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous(),
                                                                 labels.t().contiguous()).t()
            ent = None
            if with_entropy:
                with torch.no_grad():
                    full = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
                    p = torch.softmax(full, -1)
                    ent = -torch.special.xlogy(p, p).sum(-1)
        return logp, ent

    # ------------------------------------------------------------------ optimizer
    def optimizer_step(self, optimizer: torch.optim.Optimizer | None = None) -> float:
        """Sync grads the Megatron way, clip by the global norm, step; return the pre-clip grad norm."""
        from quads_megatron.megatron import sync_grads

        optimizer = optimizer or self.optimizer
        sync_grads(self.model)
        norm = self.grad_norm()
        if self.clip_grad > 0 and math.isfinite(norm) and norm > self.clip_grad:
            scale = self.clip_grad / (norm + 1e-6)
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        if math.isfinite(norm):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if self.plan.train_quantizes:
            from quads_megatron.megatron import post_optimizer_hook

            post_optimizer_hook(self.model)
        return norm

    def first_nonfinite_weight(self) -> str | None:
        """The name of the first parameter holding NaN/Inf, or None; one max-abs reduction over all of them
        (no overflow, NaN propagates) unless something is wrong."""
        params = [(n, p.detach()) for n, p in self.model.named_parameters()]
        if not params:
            return None
        peak = torch.nn.utils.get_total_norm([p for _, p in params], norm_type=float("inf"))
        if bool(torch.isfinite(peak)):
            return None
        return next((n for n, p in params if not bool(torch.isfinite(p).all())), None)

    def largest_weight(self) -> str:
        """``name |w|max=...`` of the parameter with the largest magnitude (or the first non-finite one): what a
        non-finite loss is reported with, since an oversized learning rate shows there first."""
        bad = self.first_nonfinite_weight()
        if bad is not None:
            return f"{bad} holds NaN or Inf"
        name, peak = max(((n, float(p.detach().abs().max())) for n, p in self.model.named_parameters()
                          if p.numel()), key=lambda item: item[1], default=("none", 0.0))
        return f"{name} |w|max={peak:.3g}"

    def grad_norm(self) -> float:
        """L2 norm of all grads over the whole model: TP shards summed over TP, expert shards over EP x ETP."""
        from megatron.core import parallel_state

        dense_sharded = torch.zeros((), dtype=torch.float64, device=self.device)
        dense_repl = torch.zeros((), dtype=torch.float64, device=self.device)
        expert = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self.model.parameters():
            if p.grad is None:
                continue
            sq = p.grad.detach().double().pow(2).sum()
            if not getattr(p, "allreduce", True):
                expert += sq
            elif getattr(p, "tensor_model_parallel", False):
                dense_sharded += sq
            else:
                dense_repl += sq
        if dist.is_initialized():
            tp_g = parallel_state.get_tensor_model_parallel_group()
            if dist.get_world_size(tp_g) > 1:
                dist.all_reduce(dense_sharded, group=tp_g)
            ex_g = parallel_state.get_expert_tensor_and_model_parallel_group()
            if dist.get_world_size(ex_g) > 1:
                dist.all_reduce(expert, group=ex_g)
        return float((dense_sharded + dense_repl + expert).sqrt())

    # ------------------------------------------------------------------ weights
    def hf_weights(self, quantized: bool = False, stacked_experts: bool = False):
        """(HF name, tensor) pairs of the full model, gathered over TP/EP (the converter's in-memory path).

        quantized: the plan's NVFP4 weights come out as ModelOpt triples (what an SGLang quads server loads).
        stacked_experts: each layer's routed experts as one ``plan.ExpertsLayer`` item (the refit's layer
        stream, quantized in two grouped launches per layer); with quantized, as one ``plan.QuantizedExperts``
        item (``plan.named_params.flat_named`` spells either out per expert).
        """
        from quads_megatron.convert import iter_hf_weights
        from quads_megatron.plan import quantize_named_params

        named = iter_hf_weights(self.model, vocab_size=self.vocab_size, stacked_experts=stacked_experts)
        return quantize_named_params(named, self.plan, keep_layers=stacked_experts) if quantized else named

    def load_hf_checkpoint(self) -> None:
        """Fill the model from --hf-checkpoint (the converters' HF -> Megatron path)."""
        from quads_megatron.convert.hf_to_megatron_weights import load_hf_into_megatron

        load_hf_into_megatron(self.model, self.hf_ckpt, progress=False)
        if self.plan.train_quantizes:
            from quads_megatron.megatron import post_optimizer_hook

            post_optimizer_hook(self.model)  # drop fake-quant caches of the initial weights

    def hf_config(self):
        """The transformers Qwen3MoeConfig that describes this model."""
        from transformers import Qwen3MoeConfig

        from quads_megatron.megatron import hf_qwen3_moe_config_dict

        d = hf_qwen3_moe_config_dict(self.config, self.vocab_size, self.max_seq_len, rotary_base=self.rotary_base,
                                     tie_word_embeddings=self.tie_word_embeddings)
        d.pop("model_type", None)
        return Qwen3MoeConfig(**d)

    def save_checkpoint(self, save_dir, iteration: int, *, common=None, rank_state=None, replace: bool = False):
        """``{save_dir}/iter_NNNNNNN`` through Megatron dist_checkpointing (collective): the sharded model,
        the AdamW state, the recipe and the HF config.json in the common state, plus the caller's extras."""
        import json

        from quads_megatron.megatron.checkpoint import HF_CONFIG_KEY, save_iteration

        common = {HF_CONFIG_KEY: json.dumps(json.loads(self.hf_config().to_json_string(use_diff=False)),
                                            sort_keys=True), **(common or {})}
        return save_iteration(self.model, save_dir, iteration, self.optimizer, common=common,
                              rank_state=rank_state, replace=replace)

    def load_checkpoint(self, load_dir):
        """Load the latest iteration of ``load_dir`` (any TP/EP layout) into the model and AdamW; None when
        it holds no checkpoint. The fake-quant caches are refreshed by the loader."""
        from quads_megatron.megatron.checkpoint import load_iteration

        return load_iteration(self.model, load_dir, self.optimizer)
