"""In-process rollout engine: HF transformers Qwen3-MoE with a KV cache, experts on our NVFP4 kernels."""

from __future__ import annotations

from typing import Iterable

import torch

from .base import Rollout, RolloutEngine, SamplingParams, check_prompt_lengths


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
    # a row whose logits hold NaN/Inf (weights blown up) samples uniformly instead of crashing multinomial (a
    # device assert on CUDA); its NaN log-prob then stops the run by name (loop.check_finite), with no host sync
    probs = torch.where(torch.isfinite(probs).all(-1, keepdim=True), probs, torch.ones_like(probs))
    if top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p  # always keeps the top token
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
    tok = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


class LocalEngine(RolloutEngine):
    """Batched sampling on a transformers Qwen3MoeForCausalLM whose experts run the chosen precision
    (``quads_megatron.rollout.RolloutModel``: weights, NVFP4 modules and calibration live there)."""

    def __init__(self, hf_config, plan, max_seq_len: int = 64, dtype: torch.dtype | None = None,
                 pad_token_id: int = 0, device: torch.device | str | None = None, kernel_layout: bool = True):
        """plan: the run's QuantPlan (which layers are NVFP4 and how; the trainer's and exporter's plan);
        kernel_layout: NVFP4 weights in the kernels' v3 byte order where the shapes fit (False: the v2
        layout everywhere, the comparison the tests make)."""
        from quads_megatron.device import resolve_device
        from quads_megatron.rollout import RolloutModel, RoutedExpertsRecorder

        self.plan = plan
        self.precision = plan.rollout_precision
        self.max_seq_len = max_seq_len
        self.pad_token_id = pad_token_id
        device = resolve_device(device)
        self.dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        self.rollout = RolloutModel(hf_config, plan, dtype=self.dtype, device=device, kernel_layout=kernel_layout)
        self.model = self.rollout.model
        self.device = device
        self.nvfp4_modules = self.rollout.modules
        self.routes = RoutedExpertsRecorder(self.model)  # each sample's top-k expert ids (SGLang's layout)
        self._loaded = False
        # The decode step is replayed from a CUDA graph when the rollout model's forward is sync-free.
        self.uses_cuda_graph = device.type == "cuda" and self.rollout.graph_safe
        # one per batch size; weights and calibrated channels are written in place, so captured graphs stay valid
        self._decoders: dict[int, StaticDecoder] = {}

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], measure_error: bool = False) -> None:
        """Load HF-named high-precision tensors; the plan's NVFP4 weights are quantized and written in place.

        measure_error: also accumulate each module's weight error (an extra dequantize per weight).
        """
        if self.rollout.load_weights(named_tensors, measure_error=measure_error):
            self._decoders.clear()  # new column tensors: graphs captured before must not replay
        self._loaded = True

    def calibrate(self, prompts: list[list[int]]) -> None:
        """Pick RAC channels and static input scales (the plan's calibration, ``plan.calibration``) from these
        prompts' activations, each prompt run alone."""
        if self.rollout.calibrate(prompts):
            self._decoders.clear()  # channel / scale tensors were rebound: graphs captured before must not replay

    def quant_error_report(self) -> dict[str, float]:
        return self.rollout.quant_error_report()

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
        from quads_megatron.rollout.routing import sample_routed_experts

        params.validate()
        if not self._loaded:
            raise RuntimeError("LocalEngine.generate before update_weights: sync the trainer's weights first")
        check_prompt_lengths(prompts, params.max_new_tokens, self.max_seq_len)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        stops = torch.tensor(sorted(set(params.stop_token_ids)) or [-1], device=self.device)
        ids, mask = self._left_pad(prompts)
        B = ids.shape[0]
        dec = self._decoders.get(B)
        if dec is None:
            dec = self._decoders[B] = StaticDecoder(self.model, B, self.max_seq_len, self.device, self.uses_cuda_graph,
                                                    self.routes)
        logits, prefill_routes = dec.prefill(ids, mask)
        toks, lps, step_routes = [], [], []
        done = torch.zeros(B, dtype=torch.bool, device=self.device)
        finished = torch.zeros(B, dtype=torch.bool, device=self.device)
        for _ in range(params.max_new_tokens):
            tok, lp = sample_next(logits, params.temperature, params.top_p, gen)
            tok = torch.where(done, torch.full_like(tok, self.pad_token_id), tok)
            toks.append(tok)
            lps.append(lp)
            alive = ~done
            hit = torch.isin(tok, stops) & alive
            finished |= hit
            done |= hit
            if bool(done.all()) or len(toks) == params.max_new_tokens:
                break
            logits, routes = dec.step(tok)
            step_routes.append(routes)
        T = torch.stack(toks, 1).tolist()
        prefill_routes = prefill_routes.cpu()
        step_routes = torch.stack(step_routes, 1).cpu() if step_routes else None  # [B, steps, L, K]
        L = torch.stack(lps, 1).tolist()
        results = []
        for i in range(B):
            n = len(T[i])
            if bool(finished[i]):
                n = next(j for j, t in enumerate(T[i]) if t in set(params.stop_token_ids)) + 1
            decode = list(step_routes[i]) if step_routes is not None else []
            routed = sample_routed_experts(prefill_routes[i], decode, len(prompts[i]), n)
            results.append(Rollout(list(prompts[i]), T[i][:n], L[i][:n], bool(finished[i]), routed_experts=routed))
        return results


class StaticDecoder:
    """Batched decode of a fixed batch size on a transformers StaticCache; on CUDA the one-token step is a CUDA graph.

    All inputs of the step live in fixed buffers (token, position, the [B, max_len] padding mask),
    so the captured graph is replayed per token; the weights it reads are the engine's in-place
    buffers, and the routers' top-k ids land in the static ``routes`` buffer [L, B, K]. Left padding:
    a row's positions count its own tokens (``mask.cumsum - 1``).
    """

    def __init__(self, model, batch: int, max_len: int, device, graph: bool, recorder):
        from transformers import StaticCache

        self.model, self.max_len, self.use_graph, self.recorder = model, max_len, graph, recorder
        self.routes = torch.zeros(recorder.num_layers, batch, recorder.top_k, dtype=torch.int32, device=device)
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        self.mask = torch.zeros(batch, max_len, dtype=torch.long, device=device)
        self.tok = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.graph, self.logits, self.t = None, None, 0

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor):
        """Run the prompts [B, P] (eager) into a reset cache; return the last position's logits [B, V] and
        the routers' top-k ids [B, P, L, K]."""
        P = ids.shape[1]
        self.cache.reset()
        self.mask.zero_()
        self.mask[:, :P] = mask
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        self.pos.copy_(pos[:, -1:] + 1)
        self.t = P
        self.recorder.enabled, self.recorder.buffer = True, None
        try:
            out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=pos, past_key_values=self.cache,
                             use_cache=True, logits_to_keep=1)
        finally:
            self.recorder.enabled = False
        return out.logits[:, -1], self.recorder.take(ids.shape[0])

    def _forward(self) -> torch.Tensor:
        self.recorder.enabled, self.recorder.buffer = True, self.routes  # copy_ into the static buffer
        try:
            return self.model(input_ids=self.tok, attention_mask=self.mask, position_ids=self.pos,
                              past_key_values=self.cache, use_cache=True).logits
        finally:
            self.recorder.enabled, self.recorder.buffer = False, None

    def _capture(self) -> None:
        """Warm up once (Triton compiles, cuBLAS handles), undo its cache advance, capture the step."""
        lengths = [layer.cumulative_length.clone() for layer in self.cache.layers]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward()
        torch.cuda.current_stream().wait_stream(stream)
        for layer, n in zip(self.cache.layers, lengths):
            layer.cumulative_length.copy_(n)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):  # records the step without running it: the cache is left as it was
            self.logits = self._forward()

    def step(self, tok: torch.Tensor):
        """Feed one token per row at the next cache slot; return the logits [B, V] of the next token and the
        routers' top-k ids of the fed token [B, L, K]."""
        if self.t >= self.max_len:
            raise RuntimeError(f"StaticDecoder: cache of {self.max_len} positions is full")
        self.mask[:, self.t] = 1
        self.tok.copy_(tok[:, None])
        if self.use_graph:
            if self.graph is None:
                self._capture()
            self.graph.replay()
            logits = self.logits
        else:
            logits = self._forward()
        self.pos += 1
        self.t += 1
        return logits[:, -1], self.routes.transpose(0, 1).clone()
