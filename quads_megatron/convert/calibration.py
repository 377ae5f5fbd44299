"""Calibrate the rollout checkpoint's activation side: per-expert input amax (``input_scale``) and RAC channels.

The BF16 HF model runs the calibration prompts; a pre-hook on every layer's ``mlp.experts``
captures its input hidden states and routing.  As ModelOpt does for MoE calibration, every
token counts for every expert's amax (so no expert is left uncalibrated); the RAC error
statistics of fc2 use the tokens actually routed to each expert (all tokens for an expert that
received none).  fc1 gets one channel set per layer, fc2 one per expert (``quads_megatron.rac``),
chosen once the layer's NVFP4 weights exist (``LayerCalibration.comp_indices``).  With
``attention=True`` pre-hooks on ``self_attn.q_proj`` and ``o_proj`` do the same for the attention
projections (q/k/v read one input, so they share one amax and one channel set).
"""

import dataclasses
import json
from pathlib import Path

import torch
from tqdm import tqdm

from quads_megatron import nvfp4, rac
from quads_megatron.errors import CheckpointError, InputError


@dataclasses.dataclass
class LayerCalibration:
    """One MoE layer: fc1/fc2 input amax ([] and [E]) and, with RAC, the activation error statistics."""

    fc1_amax: torch.Tensor
    fc2_amax: torch.Tensor
    fc1_stats: "rac.ActivationStats | None" = None
    fc2_routed: list | None = None      # ActivationStats per expert, tokens routed to it
    fc2_all: list | None = None         # ActivationStats per expert, every token
    attn: "AttentionCalibration | None" = None

    def comp_indices(self, w13: torch.Tensor, w2: torch.Tensor, k: int) -> tuple:
        """RAC channel sets ``(fc1 [k], fc2 [E, k])`` ranked with the quantized weights' column norms.

        w13 [E, 2F, H] / w2 [E, H, F]: dequantized NVFP4 weights (what the rollout GEMM multiplies).
        """
        if self.fc1_stats is None:
            raise ValueError("comp_indices: calibrate(..., rac=True) was not run")
        for name, stats in (("hidden_size", self.fc1_stats), ("moe_intermediate_size", self.fc2_all[0])):
            if k > stats.num_channels or k % nvfp4.BLOCK_SIZE:
                raise CheckpointError(f"--rac-channels {k}: must be a multiple of {nvfp4.BLOCK_SIZE} "
                                      f"and <= {name}={stats.num_channels}")
        fc1 = rac.calibrate_comp_channels(self.fc1_stats, rac.weight_column_norm_sq(w13, per_expert=False), k)
        sq2 = torch.stack([(r if r.count.item() > 0 else a).mean_sq_err()
                           for r, a in zip(self.fc2_routed, self.fc2_all)])
        fc2 = rac.calibrate_comp_channels(sq2, rac.weight_column_norm_sq(w2, per_expert=True), k)
        return fc1, fc2


@dataclasses.dataclass
class AttentionCalibration:
    """One attention block: q/k/v and o_proj input amax and, with RAC, their error statistics."""

    qkv_amax: torch.Tensor
    o_amax: torch.Tensor
    qkv_stats: "rac.ActivationStats | None" = None
    o_stats: "rac.ActivationStats | None" = None

    def comp_indices(self, w_qkv: torch.Tensor, w_o: torch.Tensor, k: int) -> tuple:
        """RAC channel sets ``(q/k/v [k], o_proj [k])`` from the dequantized NVFP4 weights."""
        if self.qkv_stats is None:
            raise ValueError("comp_indices: calibrate(..., rac_stats=True) was not run")
        qkv = rac.calibrate_comp_channels(self.qkv_stats, rac.weight_column_norm_sq(w_qkv, per_expert=False), k)
        o = rac.calibrate_comp_channels(self.o_stats, rac.weight_column_norm_sq(w_o, per_expert=False), k)
        return qkv, o


def load_prompts(path, tokenizer_dir, *, num_samples: int, seq_len: int, vocab_size: int | None = None) -> list:
    """Token id tensors from a .txt (one prompt per line) or .jsonl ("text"/"prompt" field) file, each cut to
    ``seq_len`` tokens.  InputError naming the file and line for an unreadable or binary file, no prompts,
    a prompt of no tokens, or a token id outside ``vocab_size`` (a tokenizer of another model)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"calibration data not found: {path}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); expected .txt or .jsonl prompts") from None
    except OSError as e:
        raise InputError(f"{path}: unreadable ({e.strerror or e})") from None
    texts = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        if "\x00" in line:
            raise InputError(f"{path}:{i + 1}: holds NUL bytes (a binary file?); expected text prompts")
        if path.suffix == ".jsonl":
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{i + 1}: not JSON ({e})") from None
            text = row.get("text", row.get("prompt")) if isinstance(row, dict) else None
            if not isinstance(text, str):
                raise InputError(f"{path}:{i + 1}: expected a 'text' or 'prompt' string field")
            texts.append((i + 1, text))
        else:
            texts.append((i + 1, line))
        if len(texts) == num_samples:
            break
    if not texts:
        raise InputError(f"{path}: no calibration prompts (the file is empty or blank)")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{tokenizer_dir}: cannot load a tokenizer for the calibration prompts ({e}); "
                              "pass --tokenizer-dir") from None
    prompts = []
    for lineno, text in texts:
        ids = torch.tensor(tok(text)["input_ids"][:seq_len], dtype=torch.long)
        if ids.numel() == 0:
            raise InputError(f"{path}:{lineno}: the prompt tokenizes to no tokens")
        if vocab_size is not None and (int(ids.max()) >= vocab_size or int(ids.min()) < 0):
            bad = int(ids.max()) if int(ids.max()) >= vocab_size else int(ids.min())
            raise InputError(f"{path}:{lineno}: token id {bad} is outside the model's vocab_size={vocab_size} "
                             f"(the tokenizer in {tokenizer_dir} is not this model's)")
        prompts.append(ids)
    return prompts


def random_prompts(vocab_size: int, *, num_samples: int, seq_len: int, seed: int = 0) -> list:
    """Seeded random token sequences: the calibration set of tiny test models without a tokenizer."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (seq_len,), generator=g) for _ in range(num_samples)]


def _capture_inputs(model, run, attention: bool):
    """Run ``run()`` with pre-hooks; return ``({layer: (x [T, H], topk [T, k])}, {layer: (qkv_in, o_in)})``."""
    captured, attn, handles = {}, {}, []
    for idx, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        if attention:
            def attn_hook(module, args, idx=idx, slot=0):
                attn.setdefault(idx, [None, None])[slot] = args[0].detach().to(torch.float32).flatten(0, -2)

            handles.append(layer.self_attn.q_proj.register_forward_pre_hook(attn_hook))
            handles.append(layer.self_attn.o_proj.register_forward_pre_hook(
                lambda m, a, idx=idx: attn_hook(m, a, idx, 1)))

        def hook(module, args, kwargs, idx=idx):
            x = args[0] if args else kwargs["hidden_states"]
            topk = args[1] if len(args) > 1 else kwargs["top_k_index"]
            captured[idx] = (x.detach().to(torch.float32), topk.detach())

        handles.append(experts.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return captured, attn


def _fc2_inputs(experts, x, e):
    gate, up = torch.nn.functional.linear(x, experts.gate_up_proj[e].to(torch.float32)).chunk(2, dim=-1)
    return experts.act_fn(gate) * up


def _for_each_batch(model, prompts, desc, progress, fn, attn_fn=None):
    device = next(model.parameters()).device
    for ids in tqdm(prompts, desc=desc, disable=not progress, unit="prompt"):
        captured, attn = _capture_inputs(model, lambda: model(ids.unsqueeze(0).to(device)), attn_fn is not None)
        for layer, (x, topk) in captured.items():
            fn(layer, model.model.layers[layer].mlp.experts, x, topk)
        for layer, (qkv_in, o_in) in attn.items():
            attn_fn(layer, qkv_in, o_in)


@torch.no_grad()
def calibrate(model, prompts, *, rac_stats: bool = False, static_scaling: bool = False,
              attention: bool = False, progress: bool = True) -> dict:
    """``{layer: LayerCalibration}`` for a transformers Qwen3MoeForCausalLM on ``prompts``.

    attention: also calibrate the attention projections (``LayerCalibration.attn``).
    rac_stats: also accumulate the RAC error statistics (a second pass, since with
    ``static_scaling`` they are measured under the static ``input_scale`` the first pass finds;
    otherwise under per-token scaling).
    """
    model.eval()
    num_layers = len(model.model.layers)
    E = model.config.num_experts
    fc1_amax = torch.zeros(num_layers)
    fc2_amax = torch.zeros(num_layers, E)

    def amax_pass(layer, experts, x, topk):
        fc1_amax[layer] = torch.maximum(fc1_amax[layer], nvfp4.amax_of(x).cpu())
        for e in range(E):
            fc2_amax[layer, e] = torch.maximum(fc2_amax[layer, e], nvfp4.amax_of(_fc2_inputs(experts, x, e)).cpu())

    attn_amax = torch.zeros(num_layers, 2)

    def attn_amax_pass(layer, qkv_in, o_in):
        for slot, x in enumerate((qkv_in, o_in)):
            attn_amax[layer, slot] = torch.maximum(attn_amax[layer, slot], nvfp4.amax_of(x).cpu())

    _for_each_batch(model, prompts, "calibrate amax", progress, amax_pass, attn_amax_pass if attention else None)
    result = {layer: LayerCalibration(fc1_amax[layer].clone(), fc2_amax[layer].clone()) for layer in range(num_layers)}
    for layer, c in result.items():
        if attention:
            c.attn = AttentionCalibration(attn_amax[layer, 0].clone(), attn_amax[layer, 1].clone())
    if not rac_stats:
        return result
    H, F = model.config.hidden_size, model.config.moe_intermediate_size
    scale = (lambda a: nvfp4.global_decode_scale(a)) if static_scaling else (lambda a: None)
    for c in result.values():
        c.fc1_stats = rac.ActivationStats(H, input_scale=scale(c.fc1_amax))
        c.fc2_routed = [rac.ActivationStats(F, input_scale=scale(c.fc2_amax[e])) for e in range(E)]
        c.fc2_all = [rac.ActivationStats(F, input_scale=scale(c.fc2_amax[e])) for e in range(E)]
        if attention:
            a = c.attn
            a.qkv_stats = rac.ActivationStats(H, input_scale=scale(a.qkv_amax))
            a.o_stats = rac.ActivationStats(model.config.num_attention_heads * model.config.head_dim,
                                            input_scale=scale(a.o_amax))

    def stats_pass(layer, experts, x, topk):
        c = result[layer]
        c.fc1_stats.update(x)
        for e in range(E):
            act = _fc2_inputs(experts, x, e)
            c.fc2_all[e].update(act)
            c.fc2_routed[e].update(act[(topk == e).any(dim=-1)])

    def attn_stats_pass(layer, qkv_in, o_in):
        result[layer].attn.qkv_stats.update(qkv_in)
        result[layer].attn.o_stats.update(o_in)

    _for_each_batch(model, prompts, "calibrate RAC", progress, stats_pass, attn_stats_pass if attention else None)
    return result
