"""Rollout engine over HTTP: SGLang servers (launched with --quantization quads) or an SGLang router."""

from __future__ import annotations

import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

import torch

from quads_megatron.errors import QuadsError

from .base import Rollout, RolloutEngine, SamplingParams, check_prompt_lengths


SYNC_MODES = ("tensor", "tensor-bf16", "disk")


class SGLangError(QuadsError, RuntimeError):
    """A server answered with an error or could not be reached: the environment's fault, one line and exit 2."""


class SGLangEngine(RolloutEngine):
    """Spreads prompts over one or more SGLang URLs; syncs weights inside begin/end_weight_update.

    Weight sync modes: "tensor" (update_weights_from_tensor: tensors handed over in flat buckets of
    ``bucket_bytes`` through shared memory / CUDA IPC, so trainer and server must share a host), "tensor-bf16" (the same with BF16
    expert weights, which the server's quads MoE method quantizes: `sends_nvfp4` is False) or "disk"
    (safetensors written to `sync_dir`, then update_weights_from_disk; works across hosts with a
    shared filesystem).
    Log-probs come from SGLang's `output_token_logprobs`, i.e. softmax(logits / temperature); each
    sample's top-k expert ids from its routed-experts capture (`return_routed_experts`), when the server
    runs with `--enable-return-routed-experts`.
    With `router_url` (an SGLang router) generation goes through the router and weight updates
    go to every worker URL.
    """

    def __init__(self, urls: list[str], max_seq_len: int, weight_sync: str = "tensor", sync_dir: str | None = None,
                 timeout_s: float = 600.0, hf_config=None, tokenizer=None, router_url: str | None = None,
                 bucket_bytes: int = 1 << 30, stacked_experts: bool = True):
        import requests  # noqa: F401  (fail early with ImportError if missing)

        if not urls:
            raise ValueError("SGLang engine: no --sglang-url given")
        if weight_sync not in SYNC_MODES:
            raise ValueError(f"--sglang-weight-sync {weight_sync!r}: expected one of {SYNC_MODES}")
        self.urls = [u.rstrip("/") for u in urls]
        self.max_seq_len = max_seq_len
        self.weight_sync = weight_sync
        self.sync_dir = sync_dir
        self.timeout_s = timeout_s
        self.hf_config = hf_config
        self.tokenizer = tokenizer
        self.router_url = router_url.rstrip("/") if router_url else None
        self.bucket_bytes = bucket_bytes
        # whole-layer expert tensors where the server allows them (`sends_stacked`): one loader call per
        # FusedMoE parameter instead of one per expert (tools/sglang_h200.py --stages update times both)
        self.stacked_experts = stacked_experts
        if self.router_url:
            self._get(self.router_url, "/health", timeout=10)
        self.tp_sizes, self.quantizations = {}, {}
        for u in self.urls:
            info = self._get(u, "/get_server_info", timeout=10)
            self.tp_sizes[u] = int(info.get("tp_size", 1)) if isinstance(info, dict) else 1
            self.quantizations[u] = info.get("quantization") if isinstance(info, dict) else None
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.urls)))

    # ------------------------------------------------------------------ HTTP
    def _request(self, method: str, url: str, path: str, payload=None, timeout=None):
        import requests

        try:
            r = requests.request(method, url + path, json=payload, timeout=timeout or self.timeout_s)
        except requests.exceptions.ConnectionError as e:
            raise SGLangError(
                f"SGLang server {url} is unreachable ({type(e).__name__}). Start one with "
                f"`python -m sglang.launch_server --model-path CKPT --quantization quads --port PORT` "
                f"or fix --sglang-url") from None
        except requests.exceptions.Timeout:
            raise SGLangError(f"SGLang server {url}{path} did not answer within {timeout or self.timeout_s:.0f} s") from None
        except requests.exceptions.RequestException as e:   # an unusable URL (InvalidURL, ...)
            raise SGLangError(f"--sglang-url {url}: {type(e).__name__}: {str(e).splitlines()[0][:200]}") from None
        if r.status_code != 200:
            raise SGLangError(f"SGLang {url}{path} returned HTTP {r.status_code}: {r.text[:500]}")
        try:
            return r.json()
        except ValueError:
            return r.text

    def _get(self, url, path, timeout=None):
        return self._request("GET", url, path, timeout=timeout)

    def _post(self, url, path, payload, timeout=None):
        out = self._request("POST", url, path, payload, timeout=timeout)
        if isinstance(out, dict) and out.get("success") is False:
            raise SGLangError(f"SGLang {url}{path} failed: {out.get('message')}")
        return out

    # ------------------------------------------------------------------ generation
    def _generate_chunk(self, url: str, prompts: list[list[int]], params: SamplingParams, seed: int) -> list[Rollout]:
        payload = {
            "input_ids": prompts,
            "sampling_params": {
                "temperature": params.temperature, "top_p": params.top_p,
                "max_new_tokens": params.max_new_tokens, "stop_token_ids": params.stop_token_ids,
                "skip_special_tokens": False, "no_stop_trim": True, "sampling_seed": seed,
            },
            "return_logprob": True,
            # SGLang's routed-experts capture (R3); a server without --enable-return-routed-experts omits them
            "return_routed_experts": True,
        }
        outs = self._post(url, "/generate", payload)
        if isinstance(outs, dict):
            outs = [outs]
        if not isinstance(outs, list) or len(outs) != len(prompts):
            raise SGLangError(f"SGLang {url}/generate returned {type(outs).__name__} for {len(prompts)} prompts")
        results = []
        for p, o in zip(prompts, outs):
            meta = o.get("meta_info", {})
            lp = meta.get("output_token_logprobs")
            if lp is None:
                raise SGLangError(f"SGLang {url}/generate: response has no meta_info.output_token_logprobs")
            ids = o.get("output_ids") or [int(t[1]) for t in lp]
            finish = (meta.get("finish_reason") or {}).get("type")
            routed = self._routed_experts(url, meta, len(p) + len(ids) - 1)
            results.append(Rollout(list(p), [int(t) for t in ids], [float(t[0]) for t in lp], finish == "stop",
                                   routed_experts=routed))
        return results

    def _routed_experts(self, url: str, meta: dict, rows: int) -> torch.Tensor | None:
        """meta_info.routed_experts (base64 of int32 [prompt + response - 1, layers, top_k], SGLang's
        detokenizer encoding) as a tensor; None when the server does not capture them or no hf_config is known."""
        import base64

        import numpy as np

        b64 = meta.get("routed_experts")
        if b64 is None or self.hf_config is None:
            return None
        flat = np.frombuffer(base64.b64decode(b64), dtype=np.int32)
        L, K = self.hf_config.num_hidden_layers, self.hf_config.num_experts_per_tok
        if flat.size != rows * L * K:
            raise SGLangError(f"SGLang {url}/generate: meta_info.routed_experts holds {flat.size} ids, expected "
                              f"{rows} tokens x {L} layers x top-{K} = {rows * L * K}")
        return torch.from_numpy(flat.copy()).view(rows, L, K)

    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int) -> list[Rollout]:
        params.validate()
        check_prompt_lengths(prompts, params.max_new_tokens, self.max_seq_len)
        targets = [self.router_url] if self.router_url else self.urls
        n = len(targets)
        bounds = [len(prompts) * i // n for i in range(n + 1)]
        futs = [self._pool.submit(self._generate_chunk, u, prompts[bounds[i]:bounds[i + 1]], params, seed + i)
                for i, u in enumerate(targets) if bounds[i + 1] > bounds[i]]
        return [r for f in futs for r in f.result()]

    # ------------------------------------------------------------------ weights
    @property
    def sends_nvfp4(self) -> bool:
        """True when the trainer quantizes before the sync (False: BF16 goes out, the server quantizes)."""
        return self.weight_sync != "tensor-bf16"

    @property
    def sends_stacked(self) -> bool:
        """True when each layer's experts go out as whole-layer FusedMoE parameters (one server load call per
        parameter, not per expert): a tensor sync to quads servers that all run tp_size 1 (every expert
        unsharded on the one rank; a sharded server slices per-expert names itself)."""
        return (self.stacked_experts and self.weight_sync in ("tensor", "tensor-bf16")
                and all(tp == 1 for tp in self.tp_sizes.values())
                and all(q == "quads" for q in self.quantizations.values()))

    def wire_items(self, named_tensors: Iterable) -> Iterable[tuple[str, torch.Tensor]]:
        """The stream as the names this sync sends (``plan.fused_moe_names.sglang_named``)."""
        from quads_megatron.plan.fused_moe_names import sglang_named

        num_experts = getattr(self.hf_config, "num_experts", None) if self.hf_config is not None else None
        return sglang_named(named_tensors, stacked=self.sends_stacked, num_experts=num_experts)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], measure_error: bool = False) -> None:
        """measure_error: ignored (the weight error is the trainer's export error, measured there). A layer's
        ``ExpertsLayer`` / ``QuantizedExperts`` item goes out as whole-layer FusedMoE parameters where
        ``sends_stacked``, else under its per-expert names."""
        named = [(k, v.detach().contiguous()) for k, v in self.wire_items(named_tensors)]
        for u in self.urls:
            self._post(u, "/begin_weight_update", {})
        try:
            if self.weight_sync in ("tensor", "tensor-bf16"):
                self._sync_tensor(named)
            else:
                self._sync_disk(named)
        finally:
            for u in self.urls:
                self._post(u, "/end_weight_update", {})

    def _sync_tensor(self, named):
        """Hand the tensors over in flat buckets: one CUDA IPC handle (or shared-memory segment) per bucket and
        TP rank, which the server splits back into views with SGLang's own ``FlattenedTensorBucket``."""
        import base64

        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        named = on_one_device(named)
        if any(t.is_cuda for _, t in named):
            monkey_patch_torch_reductions()  # CUDA IPC handles that name the device by UUID, as SGLang expects
        buckets = flat_buckets(named, self.bucket_bytes)
        for i, group in enumerate(buckets):
            bucket = FlattenedTensorBucket(named_tensors=group)
            payload = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
            for u in self.urls:
                # one payload per server TP rank (each rank deserializes its own copy), as sglang.Engine does
                blobs = [base64.b64encode(MultiprocessingSerializer.serialize(payload)).decode()
                         for _ in range(self.tp_sizes[u])]
                self._post(u, "/update_weights_from_tensor", {"serialized_named_tensors": blobs,
                                                             "load_format": "flattened_bucket",
                                                             "flush_cache": i == len(buckets) - 1})

    def _sync_disk(self, named):
        from safetensors.torch import save_file

        from quads_megatron.output_dir import atomic_output_dir

        base = self.sync_dir or tempfile.mkdtemp(prefix="quads_sync_")
        final = os.path.join(base, "weights")
        # rewritten every sync: no manifest (the server reads it at once), the previous copy replaced last
        with atomic_output_dir(final, force=True, flag="--sglang-sync-dir", manifest=False) as tmp:
            # a host copy per tensor (views of one buffer, e.g. gate and up's shared weight_scale_2, are refused)
            save_file({k: v.clone() if v.device.type == "cpu" else v.cpu() for k, v in named},
                      os.path.join(tmp, "model.safetensors"))
            if self.hf_config is not None:
                self.hf_config.save_pretrained(tmp)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(tmp)
        for u in self.urls:
            self._post(u, "/update_weights_from_disk", {"model_path": final, "flush_cache": True})

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def on_one_device(named: list) -> list:
    """The pairs on one device, the first accelerator's among them (else the host): a bucket is one flat tensor,
    and a sync stream mixes the weights on the GPU with the calibration's host-side input scales and RAC
    channel sets (bytes), which move to the weights' device."""
    device = next((t.device for _, t in named if t.device.type != "cpu"), torch.device("cpu"))
    return [(k, t if t.device == device else t.to(device)) for k, t in named]


def flat_buckets(named: list, bucket_bytes: int) -> list[list]:
    """Split (name, tensor) pairs into buckets of at most ``bucket_bytes`` (a larger tensor travels alone).

    Within a bucket the tensors are ordered by element size, largest first, so that every tensor's byte
    offset in the flat uint8 buffer is a multiple of its element size (the server views it in place)."""
    buckets, current, size = [], [], 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if current and size + n > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append((name, t))
        size += n
    if current:
        buckets.append(current)
    return [sorted(b, key=lambda nt: -nt[1].element_size()) for b in buckets]


def parse_urls(values: list[str] | None) -> list[str]:
    """Split --sglang-url values (repeatable, comma-separated) into a list of base URLs."""
    urls = []
    for v in values or []:
        urls += [u.strip() for u in v.split(",") if u.strip()]
    from urllib.parse import urlsplit

    for u in urls:
        if not u.startswith(("http://", "https://")):
            raise ValueError(f"--sglang-url {u!r}: expected http://HOST:PORT")
        try:
            parts = urlsplit(u)
            port = parts.port
        except ValueError:   # urllib: "Port out of range 0-65535", "Port could not be cast to integer value"
            raise ValueError(f"--sglang-url {u}: the port must be a number in 1-65535") from None
        if not parts.hostname:
            raise ValueError(f"--sglang-url {u}: no host (expected http://HOST:PORT)")
        if port == 0:
            raise ValueError(f"--sglang-url {u}: the port must be a number in 1-65535")
    return urls


