"""The GRPO training loop: rollout -> reward -> advantages -> Megatron update -> weight sync, with logging."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from quads_megatron.errors import CheckpointError, ConfigError, InputError, NonFiniteError, run_cli

from .advantages import grpo_advantages
from .arguments import parse_args
from .batch import build_sft_batch, build_train_batch, decode_response, encode_prompt
from .engines.base import SamplingParams, check_prompt_lengths
from .loss import LossConfig, masked_mean, policy_loss
from .metrics import (StepLogger, history_record, history_summary, mismatch_stats, reward_window,
                      routing_disagreement_counts)
from .tasks import build_task
from .tokenizer import load_tokenizer


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _print(*a):
    if _rank0():
        print(*a, flush=True)


def _comm_device() -> torch.device:
    """Where collective tensors live: CUDA under NCCL, CPU under gloo."""
    nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def _dp_mean(values: dict[str, float], group) -> dict[str, float]:
    """Average scalars over the data-parallel group (every rank gets the result)."""
    if not values or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return values
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t, group=group)
    t /= dist.get_world_size(group)
    return dict(zip(keys, t.tolist()))


def _any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is True on any rank (so all ranks stop together, none hangs)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def check_finite(what: str, step: int, bad_here: bool, note: str = "") -> None:
    """NonFiniteError naming ``what`` and the GRPO step when it is NaN/Inf on any rank (collective).

    Raised before the step's optimizer update and save, so the last good checkpoint stays the latest.
    """
    if _any_rank(bad_here):
        raise NonFiniteError(f"step {step}: {what} is NaN or Inf{note}; stopping before the optimizer update and "
                             "before saving, so the last checkpoint is the last good one")


def check_finite_weights(policy, step, lr: str) -> None:
    """NonFiniteError naming the step and the first weight that holds NaN/Inf after an optimizer update (a
    learning rate ``lr`` too large for the model), on any rank; before the step is saved."""
    bad = policy.first_nonfinite_weight()
    if _any_rank(bad is not None):
        where = f"weight {bad}" if bad is not None else "a weight on another rank"
        raise NonFiniteError(f"{'step ' if isinstance(step, int) else ''}{step}: {where} holds NaN or Inf after the "
                             f"optimizer update ({lr} too large?); stopping before saving, so the last checkpoint is "
                             "the last good one")


def _nonfinite(t: torch.Tensor, mask: torch.Tensor | None = None) -> bool:
    """Whether ``t`` (at the positions of ``mask``, when given) holds NaN or Inf."""
    if mask is not None:
        t = t[mask.bool()]
    return not bool(torch.isfinite(t).all())


def _set_threads():
    """Split the machine's cores between the local ranks (torchrun sets LOCAL_WORLD_SIZE)."""
    if torch.cuda.is_available():
        return
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))


def _write_summary(path: Path, text: str, flag: str) -> None:
    """Write ``text`` to ``path`` through a sibling temporary file, so a full or read-only disk leaves the old
    file as it was; the OSError is a one-line ConfigError naming ``flag``."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        if tmp.parent.is_dir():
            tmp.unlink(missing_ok=True)
        raise ConfigError(f"{flag}: writing {path} failed: {e.strerror or e}") from None


class GRPOTrainer:
    """Holds the policy, rollout engine, task and logger; `run()` executes the whole job."""

    def __init__(self, args):
        from .policy import MegatronPolicy

        self.args = args
        _set_threads()
        tok_path = args.tokenizer or args.hf_checkpoint
        self.tokenizer = load_tokenizer(tok_path)
        # the tiny default's HF vocabulary: the char tokenizer rounded up to 128 rows
        vocab = int(math.ceil(len(self.tokenizer) / 128) * 128)
        self.task = build_task(args.task, seed=args.seed, eval_path=args.eval_data)
        # validate every eval prompt now, before the model is built: a too-long prompt fails before any work
        self.eval_samples = self.task.eval_set()
        if not self.eval_samples:
            raise InputError(f"task {args.task!r} has an empty eval set")
        fixed = self.eval_samples + list(getattr(self.task, "samples", []))  # a JSONL task's training rows too
        try:
            check_prompt_lengths([encode_prompt(self.tokenizer, s.prompt) for s in fixed], args.max_new_tokens,
                                 args.seq_length)
        except ValueError as e:
            raise InputError(f"--task {args.task}: {e}") from None
        self.policy = MegatronPolicy(args, vocab)
        self._check_token_ids(fixed)
        self.dp_rank, self.dp_size = self.policy.dp_rank_size()
        if args.rollout_batch_size % self.dp_size:
            raise ConfigError(f"--rollout-batch-size {args.rollout_batch_size} is not divisible by the "
                             f"data-parallel size {self.dp_size}")
        self.prompts_per_rank = args.rollout_batch_size // self.dp_size
        G = args.n_samples_per_prompt
        total = args.rollout_batch_size * G
        gbs = args.global_batch_size or total
        if total % gbs or gbs % self.dp_size:
            raise ConfigError(f"--global-batch-size {gbs} must divide rollout-batch-size x n-samples-per-prompt "
                             f"({total}) and be divisible by the data-parallel size {self.dp_size}")
        self.steps_per_rollout = total // gbs
        self.local_batch = gbs // self.dp_size
        self.eos = self.tokenizer.eos_token_id
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos
        self.loss_cfg = LossConfig(clip_eps=args.eps_clip, clip_eps_high=args.eps_clip_high, tis=args.use_tis,
                                   tis_cap=args.tis_cap, mis=args.use_mis, mis_low=args.mis_low,
                                   mis_high=args.mis_high, kl_coef=args.kl_coef)
        self.sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                       max_new_tokens=args.max_new_tokens, stop_token_ids=[self.eos])
        self.greedy = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens, stop_token_ids=[self.eos])
        self._server = None  # the SGLang server process started by --sglang-launch
        self._calibration_model = None  # rank 0, SGLang engine: the rollout model a live sync calibrates (fp32)
        self.engine = self._build_engine()
        self.logger = StepLogger(args.tensorboard_dir, enabled=_rank0())
        self.history: list[dict] = []

    # ------------------------------------------------------------------ setup
    def _build_engine(self):
        a = self.args
        if a.rollout_engine == "sglang":
            import shlex

            from .engines.sglang_http import SGLangEngine, parse_urls

            urls = parse_urls(a.sglang_url)
            if a.sglang_launch:
                from .engines.sglang_launch import export_rollout_checkpoint, launch_server

                run_dir = Path(a.tensorboard_dir) / "sglang"
                calib = [s.prompt for s in self.task.train_batch(64, seed=-1)]
                ckpt_dir = export_rollout_checkpoint(self.policy, self.tokenizer, run_dir, calib)
                url = f"http://127.0.0.1:{a.sglang_port}"
                if _rank0():
                    url, self._server = launch_server(ckpt_dir, a.sglang_port, shlex.split(a.sglang_server_args),
                                                      run_dir / "server.log")
                if dist.is_initialized():
                    dist.barrier()
                urls = [url] + urls
            return SGLangEngine(urls, a.seq_length, weight_sync=a.sglang_weight_sync,
                                sync_dir=a.sglang_sync_dir, hf_config=self.policy.hf_config(), tokenizer=self.tokenizer,
                                router_url=a.sglang_router_url)
        from .engines.local import LocalEngine

        return LocalEngine(self.policy.hf_config(), self.policy.plan, max_seq_len=a.seq_length,
                           pad_token_id=self.pad)

    # ------------------------------------------------------------------ pieces of a step
    def calibration_prompts(self) -> list[list[int]]:
        """The fixed prompt batch every weight sync recalibrates the rollout's activation side on."""
        return [encode_prompt(self.tokenizer, s.prompt) for s in self.task.train_batch(16, seed=-1)]

    def sync_weights(self, measure_error: bool = False):
        """Trainer -> rollout engine weight sync; recalibrate input scales and RAC channels on a fixed prompt batch.

        The local engine calibrates its own modules after the load; for SGLang servers rank 0 runs the same
        calibration (``plan.calibration`` on a ``rollout.RolloutModel`` of the synced weights) and sends the
        resulting ``input_scale`` / ``input_comp_index`` tensors with the weights, so a server holds what the
        local engine would. SGLang servers are shared by all ranks: every rank joins the gather, rank 0 pushes.
        measure_error: the engine also measures its NVFP4 weight error (for quant_error_report).
        """
        sglang = self.args.rollout_engine == "sglang"
        calibrate = self.policy.plan.rollout_precision.quantizes_activations
        if sglang and calibrate:
            weights = self._sglang_weights_with_calibration()
        else:
            # the layer stream: the local engine loads it whole; an SGLang sync receives per-expert views of it
            weights = self.policy.hf_weights(quantized=sglang and self.engine.sends_nvfp4, stacked_experts=True)
        if sglang and not _rank0():
            for _ in weights:
                pass
        else:
            self.engine.update_weights(weights, measure_error=measure_error)
        if sglang and dist.is_initialized():
            dist.barrier()
        if not sglang and calibrate:
            self.engine.calibrate(self.calibration_prompts())

    def _sglang_weights_with_calibration(self):
        """Rank 0: the synced weights (NVFP4 where the plan says and the engine wants it) followed by the
        activation-side tensors of their calibration; other ranks: the gather to join. The weights stream
        through the calibration model, whose NVFP4 buffers are what is sent (built once, nothing held)."""
        from quads_megatron.plan import QuantizedExperts
        from quads_megatron.plan.named_params import rollout_items
        from quads_megatron.rollout import CALIBRATION_DTYPE, RolloutModel

        if not _rank0():
            return self.policy.hf_weights(stacked_experts=True)
        if self._calibration_model is None:
            from quads_megatron.device import resolve_device

            # kernel_layout=False: the sync sends this model's NVFP4 buffers after the stream, in ModelOpt order
            self._calibration_model = RolloutModel(self.policy.hf_config(), self.policy.plan,
                                                   dtype=CALIBRATION_DTYPE, device=resolve_device(None),
                                                   kernel_layout=False)
        model, nvfp4 = self._calibration_model, self.engine.sends_nvfp4

        def stream():
            for item in model.load_groups(self.policy.hf_weights(stacked_experts=True)):
                if isinstance(item, QuantizedExperts):  # a whole layer: the engine picks its wire names
                    yield item if nvfp4 else item.source
                else:
                    yield from rollout_items(item, quantized=nvfp4)
            model.calibrate(self.calibration_prompts())
            yield from model.activation_tensors()
        return stream()

    def rollout(self, step: int):
        """Generate G responses for this rank's prompts; return (samples, rollouts, rewards [N])."""
        G = self.args.n_samples_per_prompt
        samples = self.task.train_batch(self.prompts_per_rank, seed=step * 9973 + self.dp_rank)
        prompts = [encode_prompt(self.tokenizer, s.prompt) for s in samples for _ in range(G)]
        rollouts = self.engine.generate(prompts, self.sampling, seed=self.args.seed * 100003 + step * 101 + self.dp_rank)
        refs = [s for s in samples for _ in range(G)]
        rewards = torch.tensor([self.task.reward(decode_response(self.tokenizer, r.response_ids), s)
                                for r, s in zip(rollouts, refs)], dtype=torch.float32)
        check_finite("the verifier's reward", step + 1, _nonfinite(rewards))
        return samples, rollouts, rewards

    def train_on(self, batch, step: int = 0):
        """One or more optimizer steps on this rank's batch; return training stats and per-token gaps.

        Before each optimizer update, a NaN/Inf trainer log-prob or loss on any rank stops the job
        (NonFiniteError), and so does a non-finite gradient norm after it (the update is skipped).
        """
        mbs = self.args.micro_batch_size
        batch = batch.to(self.policy.device)
        stats = {"loss": 0.0, "pg_clipfrac": 0.0, "tis_weight_mean": 0.0, "tis_clipfrac": 0.0, "mis_maskfrac": 0.0,
                 "ppo_ratio_mean": 0.0, "ess_ratio": 0.0, "entropy": 0.0, "grad_norm": 0.0,
                 "train_rollout_logprob_abs_diff": 0.0, "train_rollout_kl": 0.0}
        old_lp = None
        replay = self.args.use_rollout_routing_replay
        if replay and batch.routes is None:
            raise ConfigError("--use-rollout-routing-replay: the rollout engine returned no routed experts "
                              "(an SGLang server needs --enable-return-routed-experts)")
        if self.steps_per_rollout > 1:
            with torch.no_grad():
                old_lp = torch.cat([self.policy.token_logprobs(mb.tokens, routes=mb.routes, replay=replay)[0]
                                    for mb in (batch.slice(i, i + mbs) for i in range(0, len(batch), mbs))])
        if old_lp is not None:
            check_finite("the trainer log-prob", step, _nonfinite(old_lp, batch.mask))
        gaps = []
        route_counts = torch.zeros(4, dtype=torch.float64)  # see metrics.routing_disagreement_counts
        for s in range(self.steps_per_rollout):
            bad = None  # the first non-finite quantity of this rank in this optimizer step
            sub_lo, sub_hi = s * self.local_batch, (s + 1) * self.local_batch
            sub = batch.slice(sub_lo, sub_hi)
            denom = sub.mask.sum().clamp_min(1.0)
            for i in range(0, len(sub), mbs):
                mb = sub.slice(i, i + mbs)
                lp, ent = self.policy.token_logprobs(mb.tokens, with_entropy=True, routes=mb.routes, replay=replay)
                if bad is None and _nonfinite(lp.detach(), mb.mask):
                    bad = "the trainer log-prob"
                olp = lp.detach() if old_lp is None else old_lp[sub_lo + i: sub_lo + i + len(mb)]
                loss, st = policy_loss(lp, olp, mb.rollout_logp, mb.advantages, mb.mask, self.loss_cfg,
                                       token_denom=denom)
                if bad is None and _nonfinite(loss.detach()):
                    bad = "the GRPO loss"
                if bad is not None:  # no backward of NaN: the step is abandoned below
                    continue
                loss.backward()
                w = float(mb.mask.sum() / denom) / self.steps_per_rollout
                stats["loss"] += loss.item() / self.steps_per_rollout
                for k, v in st.items():
                    stats[k] += float(v) * w
                stats["entropy"] += float(masked_mean(ent, mb.mask)) * w
                if s == 0:  # mismatch is measured against the policy that generated the batch
                    mm = mismatch_stats(olp, mb.rollout_logp, mb.mask)
                    for k, v in mm.items():
                        stats[k] += float(v) * float(mb.mask.sum() / denom)
                    gaps.append((olp - mb.rollout_logp)[mb.mask.bool()])
                    if self.policy.last_routing_diff is not None:
                        route_counts += routing_disagreement_counts(self.policy.last_routing_diff, mb.mask)
            weights = self._weights_note() if bad else ""
            for what in ("the trainer log-prob", "the GRPO loss"):
                check_finite(what, step, bad == what, weights)
            norm = self.policy.optimizer_step()
            check_finite(f"the gradient norm ({norm})", step, not math.isfinite(norm),
                         self._weights_note() if not math.isfinite(norm) else "")
            check_finite_weights(self.policy, step, f"--lr {self.args.lr}")
            stats["grad_norm"] += norm / self.steps_per_rollout
        if batch.routes is not None:  # the trainer's top-k set vs the rollout's, per (token, MoE layer)
            stats["routing_disagreement"] = float(route_counts[0] / route_counts[1].clamp_min(1))
            stats["routing_disagreement_any_layer"] = float(route_counts[2] / route_counts[3].clamp_min(1))
        return stats, torch.cat(gaps).cpu() if gaps else torch.zeros(0)

    @torch.no_grad()
    def evaluate(self) -> float:
        """pass@1 (greedy) on the held-out set, split over DP ranks."""
        ev = self.eval_samples[self.dp_rank::self.dp_size]
        correct = torch.zeros(2, dtype=torch.float64, device=_comm_device())
        if ev:
            outs = self.engine.generate([encode_prompt(self.tokenizer, s.prompt) for s in ev], self.greedy, seed=0)
            correct[0] = sum(self.task.reward(decode_response(self.tokenizer, o.response_ids), s) for o, s in zip(outs, ev))
            correct[1] = len(ev)
        if dist.is_initialized():
            dist.all_reduce(correct, group=self.policy.dp_group())
        return float(correct[0] / correct[1].clamp_min(1))

    def sft_warmup(self):
        """Supervised warm-up on the task's reference answers so GRPO starts with non-zero reward."""
        a = self.args
        if a.sft_iters <= 0:
            return
        opt = torch.optim.AdamW(self.policy.model.parameters(), lr=a.sft_lr, betas=(0.9, 0.99))
        per_rank = max(1, a.sft_batch_size // self.dp_size)
        t0 = time.perf_counter()
        for it in range(a.sft_iters):
            samples = self.task.train_batch(per_rank, seed=-(10**6) - it * 9973 - self.dp_rank)
            prompts = [encode_prompt(self.tokenizer, s.prompt) for s in samples]
            targets = [self.tokenizer.encode(self.task.sft_text(s), add_special_tokens=False) + [self.eos]
                       for s in samples]
            tokens, mask = build_sft_batch(prompts, targets, self.pad)
            mask = mask.to(self.policy.device)
            lp, _ = self.policy.token_logprobs(tokens)
            loss = -masked_mean(lp, mask)
            loss.backward()
            self.policy.optimizer_step(opt)
            check_finite_weights(self.policy, f"SFT warm-up iteration {it + 1}", f"--sft-lr {a.sft_lr}")
            if it % 20 == 0 or it == a.sft_iters - 1:
                _print(f"[sft] iter {it + 1}/{a.sft_iters} loss {loss.item():.4f} ({time.perf_counter() - t0:.1f}s)")
        self.logger.text("sft", f"{a.sft_iters} warm-up steps, final loss {loss.item():.4f}")

    # ------------------------------------------------------------------ the job
    def run(self) -> dict:
        a = self.args
        start, rng_state = 0, None
        state = self._load_checkpoint() if a.load else None
        if state is not None:
            start, rng_state = state["iteration"], state["rng"]
        else:
            if a.hf_checkpoint:
                self.policy.load_hf_checkpoint()
            self.sft_warmup()
        if _rank0():
            self.logger.text("config", "\n".join(f"    --{k.replace('_', '-')} {v}" for k, v in sorted(vars(a).items())))
        self.sync_weights()
        pass_before = self.evaluate() if start == 0 else (self.history[0].get("pass_before") if self.history else None)
        if start == 0:
            self.history = [{"pass_before": pass_before}]
            self.logger.log(0, {"eval/pass@1": pass_before}, line=False)
        _print(f"pass@1 before GRPO: {pass_before:.3f}" if pass_before is not None else "")
        bar = None
        if _rank0() and not a.no_progress and sys.stderr.isatty():
            from tqdm import tqdm

            bar = tqdm(total=a.train_iters, initial=start, desc="GRPO", dynamic_ncols=True, leave=False)
        if rng_state is not None:  # the RNGs as the saving run left them when it went on to the next step
            from quads_megatron.megatron.checkpoint import set_rng_state

            set_rng_state(rng_state)
        saved = False
        for step in range(start, a.train_iters):
            t0 = time.perf_counter()
            samples, rollouts, rewards = self.rollout(step)
            t1 = time.perf_counter()
            adv = grpo_advantages(rewards, a.n_samples_per_prompt, normalize_std=not a.disable_grpo_std_normalization)
            batch = build_train_batch(rollouts, adv, self.pad)
            bad_rollout = _nonfinite(batch.rollout_logp, batch.mask)
            check_finite("the rollout log-prob (from the rollout engine)", step + 1, bad_rollout,
                         self._weights_note() if bad_rollout else "")
            stats, gaps = self.train_on(batch, step + 1)
            t2 = time.perf_counter()
            it = step + 1
            report_quant = bool(a.quant_error_interval) and (it % a.quant_error_interval == 0 or it == 1)
            self.sync_weights(measure_error=report_quant)
            t3 = time.perf_counter()
            resp_len = torch.tensor([len(r.response_ids) for r in rollouts], dtype=torch.float32)
            n_gen = float(resp_len.sum())
            scalars = {
                "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std(unbiased=False)),
                "response/length_mean": float(resp_len.mean()),
                "response/finished_frac": sum(r.finished for r in rollouts) / len(rollouts),
                "loss/policy": stats["loss"], "policy/entropy": stats["entropy"],
                "policy/pg_clipfrac": stats["pg_clipfrac"], "policy/ppo_ratio_mean": stats["ppo_ratio_mean"],
                "optim/grad_norm": stats["grad_norm"], "optim/lr": a.lr,
                "mismatch/train_rollout_logprob_abs_diff": stats["train_rollout_logprob_abs_diff"],
                "mismatch/train_rollout_kl": stats["train_rollout_kl"],
                "mismatch/tis_weight_mean": stats["tis_weight_mean"], "mismatch/tis_clipfrac": stats["tis_clipfrac"],
                "mismatch/mis_maskfrac": stats["mis_maskfrac"],
                "mismatch/ess_ratio": stats["ess_ratio"],
                **{f"mismatch/{k}": stats[k] for k in ("routing_disagreement", "routing_disagreement_any_layer")
                   if k in stats},
                "mismatch/logprob_abs_diff_p99": float(torch.quantile(gaps.abs().double(), 0.99)) if gaps.numel() else 0.0,
                "time/rollout": t1 - t0, "time/train": t2 - t1, "time/sync": t3 - t2, "time/step": t3 - t0,
                "throughput/rollout_tokens_per_s": n_gen / max(t1 - t0, 1e-9),
                "throughput/train_tokens_per_s": float(batch.mask.sum()) / max(t2 - t1, 1e-9),
            }
            scalars = _dp_mean(scalars, self.policy.dp_group())
            if a.eval_interval and (it % a.eval_interval == 0 or it == a.train_iters):
                scalars["eval/pass@1"] = self.evaluate()
            if report_quant:
                for k, v in self.engine.quant_error_report().items():
                    scalars[f"quant/{k}"] = v
            self.history.append(history_record(it, scalars))
            if it % a.log_interval == 0 or it == a.train_iters:
                line = self.logger.log(it, scalars, {"mismatch/logprob_gap": gaps}, line=False)
                if bar is not None:
                    bar.write(line)
                elif _rank0():
                    print(line, flush=True)
            if bar is not None:
                bar.update(1)
            # Megatron's rule: every --save-interval steps, and always at the end of training
            if a.save and ((a.save_interval and it % a.save_interval == 0) or it == a.train_iters):
                self._save_checkpoint(it, first=not saved)
                saved = True
        if bar is not None:
            bar.close()
        return self.summary()

    # ------------------------------------------------------------------ checkpoints
    LOOP_STATE_KEY = "grpo_loop"  # the loop's common state in the checkpoint: iteration, history, args

    def _save_checkpoint(self, iteration: int, first: bool):
        """{save}/iter_NNNNNNN via Megatron dist_checkpointing (quads_megatron.megatron.checkpoint) + {save}/hf.

        ``first`` (this run's first save): {save}/hf (config.json + tokenizer, what the converters
        read) is (re)written, and with --force the old run's iterations are replaced.
        """
        from quads_megatron.megatron.checkpoint import get_rng_state

        a = self.args
        if first and _rank0():
            self._write_hf_dir(Path(a.save))
        # plain data only: dist_checkpointing reads the common state back with torch.load(weights_only=True)
        args = json.dumps(vars(a), sort_keys=True, default=lambda o: o.to_dict() if hasattr(o, "to_dict") else str(o))
        common = {self.LOOP_STATE_KEY: {"iteration": iteration, "history": self.history, "args": args, "task": a.task}}
        self.policy.save_checkpoint(a.save, iteration, common=common, rank_state={"rng": get_rng_state()},
                                    replace=first and bool(getattr(a, "force", False)))

    def _write_hf_dir(self, save: Path):
        """{save}/hf (config.json + tokenizer) through the atomic writer; the run holds the lock of {save}."""
        from quads_megatron.output_dir import atomic_output_dir

        with atomic_output_dir(save / "hf", force=True, flag="--save", lock=False) as tmp:
            self.tokenizer.save_pretrained(tmp)
            self.policy.hf_config().save_pretrained(tmp)

    def _load_checkpoint(self):
        """Resume from --load: model + AdamW (any TP/EP layout), history; None when it holds no checkpoint."""
        a = self.args
        state = self.policy.load_checkpoint(a.load)
        if state is None:
            _print(f"{a.load} holds no checkpoint yet: starting from scratch")
            return None
        loop_state = state["common"].get(self.LOOP_STATE_KEY)
        if loop_state is None:
            raise CheckpointError(f"--load {a.load}: {state['dir']} is not a GRPO checkpoint (no "
                             f"'{self.LOOP_STATE_KEY}' state); use --hf-checkpoint for initial weights")
        self.history = loop_state["history"]
        rng = (state["rank_state"] or {}).get("rng")
        if rng is None:
            _print("note: RNG states not restored (the checkpoint was saved with another parallel layout)")
        _print(f"resumed from {state['dir']} at iteration {state['iteration']}")
        return {"iteration": state["iteration"], "rng": rng}

    def _weights_note(self) -> str:
        """What a non-finite quantity is reported with: the largest (or first non-finite) weight and the lr."""
        return f" (largest weight: {self.policy.largest_weight()}; --lr {self.args.lr})"

    def _check_token_ids(self, samples) -> None:
        """Every token id the run feeds the model (the task's prompts, BOS/EOS/PAD) lies inside its vocabulary:
        a tokenizer of another model is an InputError naming it, not an index error inside the embedding."""
        vocab = self.policy.vocab_size
        source = f"the tokenizer of {self.args.tokenizer or self.args.hf_checkpoint or 'the built-in characters'}"
        for what, tid in (("eos_token_id", self.tokenizer.eos_token_id), ("pad_token_id", self.tokenizer.pad_token_id),
                          ("bos_token_id", self.tokenizer.bos_token_id)):
            if tid is not None and not 0 <= tid < vocab:
                raise InputError(f"{source}: {what}={tid} is outside the model's vocabulary of {vocab} tokens; "
                                 "use the model's own tokenizer")
        for s in samples:
            ids = encode_prompt(self.tokenizer, s.prompt)
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise InputError(f"--task {self.args.task}: prompt {s.prompt[:40]!r} encodes (with {source}) to token "
                                 f"id {bad}, outside the model's vocabulary of {vocab} tokens; use the model's own "
                                 "tokenizer")

    def summary(self) -> dict:
        """Reward before/after, pass@1 before/after, mean log-prob gap: printed, to TensorBoard and JSON."""
        steps = [h for h in self.history if "step" in h]
        k = reward_window(len(steps))
        out = {
            **history_summary(steps, self.history[0].get("pass_before") if self.history else None),
            "rollout_routing_replay": bool(self.args.use_rollout_routing_replay),
            "rollout_precision": self.args.recipe.rollout_precision.value,
            "train_precision": self.args.recipe.train_precision.value,
            "tensorboard_dir": str(self.args.tensorboard_dir),
        }
        if _rank0():
            fmt = lambda v: "n/a" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))
            text = (f"summary ({out['train_precision']} trainer, {out['rollout_precision']} rollout, {out['steps']} steps): "
                    f"reward {fmt(out['reward_before'])} -> {fmt(out['reward_after'])} (mean of first/last {k} steps), "
                    f"pass@1 {fmt(out['pass@1_before'])} -> {fmt(out['pass@1_after'])}, "
                    f"mean |logp_train - logp_rollout| {fmt(out['mean_logprob_abs_diff'])}")
            print(text, flush=True)
            self.logger.text("summary", text)
            for flag, path in (("--tensorboard-dir", os.path.join(self.args.tensorboard_dir, "summary.json")),
                               ("--summary-json", self.args.summary_json)):
                if path:
                    _write_summary(Path(path), json.dumps(out, indent=2) + "\n", flag)
        return out

    def close(self):
        self.logger.close()
        self.engine.close()
        if self._server is not None:
            self._server.terminate()
            self._server.wait(timeout=60)


PROG = "train_grpo_moe"


def die_with_parent() -> None:
    """A torchrun worker (LOCAL_RANK set by the launcher) gets SIGTERM when its launcher dies, so killing
    the launcher's process group (the workers run in their own sessions) leaves no trainer writing to --save."""
    if "LOCAL_RANK" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        return
    if os.getppid() == 1:  # the launcher died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


@contextlib.contextmanager
def claim_save_dir(save):
    """Hold the lock of --save for the whole run (rank 0; a second run on it stops with exit 2 naming this
    one) and remove the iteration / hf temporaries a killed run left in it."""
    from quads_megatron.output_dir import is_writer_rank, output_lock, remove_stale_temp_dirs_in

    if not save or not is_writer_rank():
        yield
        return
    with output_lock(save, flag="--save"):
        remove_stale_temp_dirs_in(save)
        yield


def run(argv=None) -> int:
    """The command line: ``main`` through ``run_cli`` (a user error: one line, exit 2; a signal: one line, 128+N)."""
    die_with_parent()
    return run_cli(main, argv, prog=PROG)


def main(argv=None) -> dict:
    """The GRPO job (returns its summary; ``run`` is the command-line wrapper of it)."""
    args = parse_args(argv)
    t0 = time.perf_counter()
    with claim_save_dir(args.save):
        trainer = GRPOTrainer(args)
        try:
            summary = trainer.run()
        finally:
            trainer.close()
    summary["wall_time_s"] = time.perf_counter() - t0
    _print(f"wall time {summary['wall_time_s']:.1f} s; TensorBoard: tensorboard --logdir {args.tensorboard_dir}")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return summary
