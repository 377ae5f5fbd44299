"""``quads-pretrain``: brief next-token pretraining of a Qwen3-MoE preset on offline text, saved as an HF checkpoint.

A random-init MoE has none of the activation-outlier structure of a trained LLM, which is what the
paper's activation-error finding is about. This trains a preset (Megatron-Core, BF16 on a GPU) on
text that exists on every machine without a download: the Python standard library's sources.
The character tokenizer of the main job is used (built in-process), and the result is written with
the converters' HF writer, so the GRPO job starts from it with ``--hf-checkpoint``.
"""

from __future__ import annotations

import argparse
import math
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from quads_megatron.errors import ConfigError, InputError, NonFiniteError, run_cli


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="quads-pretrain", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="moe-240m", help="Qwen3-MoE preset of quads_megatron.megatron.presets")
    p.add_argument("--data-path", default=None,
                   help="a text file or a directory of *.py/*.txt/*.rst files (default: this Python's stdlib)")
    p.add_argument("--data-bytes", type=int, default=64 << 20, help="read at most this many bytes of text")
    p.add_argument("--train-iters", type=int, default=600)
    p.add_argument("--micro-batch-size", type=int, default=64, help="sequences per rank per step")
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--lr-warmup-iters", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--bf16", action="store_true", help="BF16 parameters (the default on a GPU)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--log-interval", type=int, default=50)
    p.add_argument("--eval-iters", type=int, default=8, help="held-out batches for the final validation loss")
    p.add_argument("--save", required=True, help="output HF checkpoint directory (config.json, safetensors, tokenizer)")
    p.add_argument("--force", action="store_true", help="replace an existing --save directory")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    args = p.parse_args(argv)
    for flag in ("train_iters", "micro_batch_size", "seq_length", "data_bytes", "log_interval"):
        if getattr(args, flag) <= 0:
            raise ConfigError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be > 0")
    if not (args.lr > 0 and 0 <= args.min_lr <= args.lr):
        raise ConfigError(f"--lr {args.lr} / --min-lr {args.min_lr}: need lr > 0 and 0 <= min-lr <= lr")
    return args


def read_corpus(path=None, max_bytes: int = 64 << 20) -> str:
    """Text of ``path`` (a file, or the sorted *.py/*.txt/*.rst files under a directory), default the stdlib."""
    root = Path(path) if path else Path(sysconfig.get_paths()["stdlib"])
    if not root.exists():
        raise InputError(f"--data-path {root}: does not exist")
    files = [root] if root.is_file() else sorted(
        p for p in root.rglob("*") if p.suffix in (".py", ".txt", ".rst") and "site-packages" not in p.parts)
    parts, n = [], 0
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        parts.append(text)
        n += len(text)
        if n >= max_bytes:
            break
    text = "\n".join(parts)[:max_bytes]
    if len(text) < 10_000:
        raise InputError(f"--data-path {root}: only {len(text)} characters of text (need >= 10000)")
    return text


def encode_corpus(text: str, tokenizer) -> torch.Tensor:
    """int32 ids of a character tokenizer for the whole text (characters outside its alphabet dropped)."""
    table = torch.full((0x110000,), -1, dtype=torch.int32)
    for tok, i in tokenizer.get_vocab().items():
        if len(tok) == 1:
            table[ord(tok)] = i
    ids = table[torch.frombuffer(bytearray(text.encode("utf-32-le")), dtype=torch.int32).long()]
    return ids[ids >= 0]


def lr_at(it: int, args) -> float:
    """Linear warm-up, then cosine decay from --lr to --min-lr (Megatron's schedule)."""
    if it < args.lr_warmup_iters:
        return args.lr * (it + 1) / args.lr_warmup_iters
    frac = (it - args.lr_warmup_iters) / max(1, args.train_iters - args.lr_warmup_iters)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * min(1.0, frac)))


def _batch(ids: torch.Tensor, n: int, seq: int, gen: torch.Generator, device) -> torch.Tensor:
    starts = torch.randint(0, ids.numel() - seq - 1, (n,), generator=gen)
    return torch.stack([ids[s: s + seq + 1] for s in starts.tolist()]).long().to(device)


def _lm_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy through GPTModel's own (vocab-parallel) loss."""
    inp, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    pos = torch.arange(inp.shape[1], device=inp.device).unsqueeze(0).expand_as(inp)
    return model(inp, pos, None, labels=labels).float().mean()


def pretrain(args) -> dict:
    """Train, evaluate on held-out text, save; return {'train_loss', 'val_loss', 'tokens', 'seconds', 'params'}."""
    from quads_megatron.convert.live import iter_hf_weights
    from quads_megatron.convert.megatron_to_hf import write_hf_checkpoint
    from quads_megatron.megatron import build_gpt_model, initialize_distributed, qwen3_moe_config, sync_grads
    from quads_megatron.megatron.presets import hf_qwen3_moe_config_dict, qwen3_moe_model_args
    from quads_megatron.rl.tokenizer import build_char_tokenizer

    initialize_distributed(seed=args.seed)
    rank, world = dist.get_rank(), dist.get_world_size()
    tok = build_char_tokenizer()
    margs = qwen3_moe_model_args(args.preset)
    vocab = margs["vocab_size"]
    if len(tok) > vocab:
        raise ConfigError(f"--preset {args.preset}: vocab_size {vocab} < the tokenizer's {len(tok)} tokens")
    bf16 = args.bf16 or torch.cuda.is_available()
    config = qwen3_moe_config(args.preset, **(dict(params_dtype=torch.bfloat16, bf16=True) if bf16 else {}))
    seq = min(args.seq_length, margs["max_seq_len"])
    model = build_gpt_model(config, vocab, margs["max_seq_len"], rotary_base=margs["rotary_base"], expert_seed=args.seed)
    device = next(model.parameters()).device
    n_params = sum(p.numel() for p in model.parameters())
    ids = encode_corpus(read_corpus(args.data_path, args.data_bytes), tok)
    split = int(ids.numel() * 0.98)
    train_ids, val_ids = ids[:split], ids[split:]
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=args.weight_decay)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    bar = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.train_iters, desc="pretrain", dynamic_ncols=True)
    t0, loss = time.perf_counter(), torch.zeros(())
    model.train()
    for it in range(args.train_iters):
        for g in opt.param_groups:
            g["lr"] = lr_at(it, args)
        loss = _lm_loss(model, _batch(train_ids, args.micro_batch_size, seq, gen, device))
        loss.backward()
        sync_grads(model)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if not torch.isfinite(loss):
            raise NonFiniteError(f"pretrain: loss is {loss.item()} at iteration {it + 1}; lower --lr")
        if bar is not None:
            bar.update(1)
            if (it + 1) % args.log_interval == 0:
                bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    vgen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        val = sum(_lm_loss(model, _batch(val_ids, args.micro_batch_size, seq, vgen, device)).item()
                  for _ in range(args.eval_iters)) / args.eval_iters
    seconds = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    hf_config = hf_qwen3_moe_config_dict(config, vocab, margs["max_seq_len"], rotary_base=margs["rotary_base"])
    weights = iter_hf_weights(model, vocab_size=vocab)
    if rank == 0:
        with tempfile.TemporaryDirectory() as tok_dir:
            tok.save_pretrained(tok_dir)
            write_hf_checkpoint(weights, hf_config, args.save, dtype=torch.bfloat16, force=args.force,
                                max_shard_bytes=5 * 10**9, tokenizer_dir=tok_dir, inputs=data_inputs(args),
                                flag="--save")
    else:
        for _ in weights:  # take part in the TP/EP gathers
            pass
    tokens = args.train_iters * args.micro_batch_size * seq * world
    out = {"preset": args.preset, "params": n_params, "train_loss": loss.item(), "val_loss": val,
           "tokens": tokens, "seconds": seconds, "seq_length": seq, "device": str(device)}
    if rank == 0:
        print(f"pretrained {args.preset} ({n_params / 1e6:.1f}M params) on {tokens / 1e6:.1f}M tokens in "
              f"{seconds:.0f}s: train loss {loss.item():.3f}, val loss {val:.3f} nats/char; wrote {args.save}", flush=True)
    return out


def data_inputs(args) -> list:
    """The ``(flag, path)`` inputs --save must not overlap: the training text (default: the stdlib)."""
    return [("--data-path", args.data_path or sysconfig.get_paths()["stdlib"])]


def main(argv=None) -> dict:
    """``quads-pretrain``: --save is claimed (checked, locked) before the model is built."""
    from quads_megatron.output_dir import claim_output

    args = parse_args(argv)
    with claim_output(args.save, force=args.force, inputs=data_inputs(args), flag="--save"):
        return pretrain(args)


def console_main():
    raise SystemExit(run_cli(main, prog="quads-pretrain"))


if __name__ == "__main__":
    console_main()
