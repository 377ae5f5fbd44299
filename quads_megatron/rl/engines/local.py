"""In-process rollout engine: HF transformers Qwen3-MoE with a KV cache, experts on our NVFP4 kernels."""

from __future__ import annotations

import re
from typing import Iterable

import torch

from .base import Rollout, RolloutEngine, SamplingParams, check_prompt_lengths

_EXPERT_RE = re.compile(r"^(?P<pre>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator):
    """Sample one token per row; return (token [B], log-prob [B] under softmax(logits / temperature)).

    temperature 0 is greedy (argmax; log-prob under softmax(logits)).
    """
    if temperature == 0:
        logp = torch.log_softmax(logits.float(), dim=-1)
        tok = logp.argmax(-1)
        return tok, logp.gather(-1, tok[:, None]).squeeze(-1)
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    probs = logp.exp()
    if top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p  # always keeps the top token
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
    tok = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


class LocalEngine(RolloutEngine):
    """Batched sampling on a transformers Qwen3MoeForCausalLM whose experts run the chosen precision."""

    def __init__(self, hf_config, plan, max_seq_len: int = 64, dtype: torch.dtype | None = None,
                 pad_token_id: int = 0, device: torch.device | str | None = None):
        """plan: the run's QuantPlan (which layers are NVFP4 and how; the trainer's and exporter's plan)."""
        from transformers import AutoModelForCausalLM

        from .precision import install_nvfp4_modules

        self.plan = plan
        self.precision = plan.rollout_precision
        self.max_seq_len = max_seq_len
        self.pad_token_id = pad_token_id
        from quads_megatron.device import resolve_device

        device = resolve_device(device)
        cfg = hf_config
        if hasattr(cfg, "_experts_implementation"):
            cfg._experts_implementation = "eager"
        cfg._attn_implementation = "eager" if device.type == "cpu" else "sdpa"
        self.dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        with torch.device(device):
            self.model = AutoModelForCausalLM.from_config(cfg, dtype=self.dtype)
        self.model.eval().requires_grad_(False)
        self.device = device
        self.nvfp4_modules = install_nvfp4_modules(self.model, plan)
        self._loaded = False

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], measure_error: bool = False) -> None:
        """Load HF-named high-precision tensors; the plan's NVFP4 weights are quantized and written in place.

        measure_error: also accumulate each module's weight error (an extra dequantize per weight).
        """
        from quads_megatron.plan import quantize_scale_groups

        from .precision import _ErrorMeter, load_quantized

        params = dict(self.model.named_parameters())
        if measure_error:
            for m in self.nvfp4_modules.values():
                m.meter = _ErrorMeter()
        seen = set()
        for names, tensors, quantized in quantize_scale_groups(named_tensors, self.plan):
            for i, (name, t) in enumerate(zip(names, tensors)):
                if quantized is not None:
                    load_quantized(self.nvfp4_modules, name, t, quantized[i].to(self.device), measure_error)
                else:
                    dst = self._destination(params, name)
                    if tuple(dst.shape) != tuple(t.shape):
                        raise ValueError(f"weight sync: {name} has shape {tuple(t.shape)}, the rollout model "
                                         f"expects {tuple(dst.shape)}")
                    dst.copy_(t.to(device=dst.device, dtype=dst.dtype))
                seen.add(name)
        if not seen:
            raise ValueError("weight sync: no tensors received")
        if getattr(self.model.config, "tie_word_embeddings", False) and "lm_head.weight" not in seen:
            self.model.lm_head.weight = self.model.model.embed_tokens.weight
        self._loaded = True

    def _destination(self, params: dict, name: str) -> torch.Tensor:
        """The HF model parameter (or the slice of a fused expert parameter) that ``name`` fills."""
        m = _EXPERT_RE.match(name)
        if not m:
            return self._param(params, name, name)
        pre, e, proj = m["pre"], int(m["e"]), m["proj"]
        if proj == "down_proj":
            return self._param(params, f"{pre}.down_proj", name)[e]
        full = self._param(params, f"{pre}.gate_up_proj", name)
        f = full.shape[1] // 2
        return full[e, :f] if proj == "gate_proj" else full[e, f:]

    @staticmethod
    def _param(params: dict, key: str, src: str) -> torch.Tensor:
        if key not in params:
            raise KeyError(f"weight sync: {src} maps to {key}, which the rollout model does not have")
        return params[key].data

    def calibrate(self, prompts: list[list[int]]) -> None:
        """Pick RAC channels and static input scales (as the plan asks) from these prompts' activations."""
        from .precision import calibrate

        calibrate(self.nvfp4_modules, self.plan, lambda: self._forward_full(prompts))

    def quant_error_report(self) -> dict[str, float]:
        from .precision import error_report

        return error_report(self.nvfp4_modules)

    # ------------------------------------------------------------------ generation
    def _left_pad(self, prompts: list[list[int]]):
        P = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), P), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), P), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, P - len(p):] = torch.tensor(p)
            mask[i, P - len(p):] = 1
        return ids.to(self.device), mask.to(self.device)

    @torch.no_grad()
    def _forward_full(self, prompts: list[list[int]]) -> torch.Tensor:
        ids, mask = self._left_pad(prompts)
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        return self.model(input_ids=ids, attention_mask=mask, position_ids=pos).logits

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int) -> list[Rollout]:
        from transformers import DynamicCache

        params.validate()
        if not self._loaded:
            raise RuntimeError("LocalEngine.generate before update_weights: sync the trainer's weights first")
        check_prompt_lengths(prompts, params.max_new_tokens, self.max_seq_len)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        stops = torch.tensor(sorted(set(params.stop_token_ids)) or [-1], device=self.device)
        ids, mask = self._left_pad(prompts)
        B = ids.shape[0]
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                         use_cache=True, logits_to_keep=1)
        next_pos = pos[:, -1:] + 1
        toks, lps = [], []
        done = torch.zeros(B, dtype=torch.bool, device=self.device)
        finished = torch.zeros(B, dtype=torch.bool, device=self.device)
        for _ in range(params.max_new_tokens):
            tok, lp = sample_next(out.logits[:, -1], params.temperature, params.top_p, gen)
            tok = torch.where(done, torch.full_like(tok, self.pad_token_id), tok)
            toks.append(tok)
            lps.append(lp)
            alive = ~done
            hit = torch.isin(tok, stops) & alive
            finished |= hit
            done |= hit
            if bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=self.device)], dim=1)
            out = self.model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos,
                             past_key_values=out.past_key_values, use_cache=True)
            next_pos = next_pos + 1
        T = torch.stack(toks, 1).tolist()
        L = torch.stack(lps, 1).tolist()
        results = []
        for i in range(B):
            n = len(T[i])
            if bool(finished[i]):
                n = next(j for j, t in enumerate(T[i]) if t in set(params.stop_token_ids)) + 1
            results.append(Rollout(list(prompts[i]), T[i][:n], L[i][:n], bool(finished[i])))
        return results
