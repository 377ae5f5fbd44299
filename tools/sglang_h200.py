"""SGLang's server with `--quantization quads` on one GPU: serving agreement, weight updates, decode throughput.

A random Qwen3-MoE at Qwen3-30B-A3B layer dimensions (``--num-layers`` of them, vocab 32768) is saved as
an HF checkpoint and exported by ``quads-export-rollout`` for each QUADS precision; then, per stage:

  agree       each QUADS checkpoint is served (CUDA graphs on); greedy tokens and log-probs of N prompts are
              compared with the local engine's on the same weights, calibration prompts and plan
  update      a running w4a4 server takes new weights through the GRPO job's sync (``tensor``, CUDA tensors
              by IPC handle) and back through ``disk``; each time its outputs are compared with a server
              started fresh on those weights (no re-capture: the server's CUDA graphs replay)
  profile     one decode batch (``--profile-batch``) on SGLang FP8 and each QUADS precision under SGLang's
              profiler: GPU time per decode step, kernel by kernel (where a QUADS step loses to FP8)
  throughput  decode tokens/s and time per output token at batch 1, 8, 64, 256 (fixed input and output
              lengths, ignore_eos) for SGLang BF16, SGLang FP8 (--quantization fp8) and the QUADS precisions
              (measured inside the agree and baselines stages)
  speed       the same throughput table (SGLang's servers: ``--baselines``), plus the profile stage's
              kernels per decode step at ``--profile-batch``, on dummy weights (``--load-format dummy``: config.json only, no checkpoint
              written or read), so every server of a deep model starts in seconds and all 48 layers fit

Needs SGLang importable (``tools/sglang_wheelhouse.sh`` builds the wheel set; ``tools/gpu_session.sh
sglang`` installs it and runs this). Writes one JSON (``--out-json``) and prints a table per stage.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# token ids in and out, room for the script's own tensors, every request prefilled in full
SERVER_FLAGS = ["--skip-tokenizer-init", "--mem-fraction-static", "0.7", "--disable-radix-cache"]
QUADS_PRECISIONS = ("w4a4_rac", "w4a4", "w4a16")
BASELINE_QUANT = {"fp8": "fp8", "bf16": None}  # SGLang's own servers: label -> --quantization
VOCAB = 32768
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def model_config(num_layers: int) -> dict:
    """HF config dict of the benchmark's Qwen3-MoE: 30B-A3B layer dims, ``num_layers`` layers, vocab 32768."""
    from quads_megatron.megatron.presets import hf_qwen3_moe_config_dict, qwen3_moe_config

    return hf_qwen3_moe_config_dict(qwen3_moe_config("qwen3-30b-a3b", num_layers=num_layers), VOCAB, 4096)


def make_checkpoint(path: Path, num_layers: int, seed: int, scale: float = 1.0) -> dict:
    """Save a random BF16 Qwen3-MoE (30B-A3B layer dims) at ``path``; return its config dict."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = model_config(num_layers)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg)).to(torch.bfloat16)
    if scale != 1.0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.ndim > 1 and "embed" not in name:
                    p.mul_(scale)
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return cfg


def export(hf: Path, out: Path, precision: str, calib: dict) -> Path:
    """``quads-export-rollout`` of ``hf`` at ``precision`` (calibrated on the seeded random prompts)."""
    from quads_megatron.convert import rollout_export

    rollout_export.main(["--load-dir", str(hf), "--save-dir", str(out), "--rollout-precision", precision,
                         "--rac-channels", str(calib["rac_channels"]), "--calib-size", str(calib["size"]),
                         "--calib-seq-len", str(calib["seq_len"]), "--seed", str(calib["seed"]),
                         "--device", DEVICE, "--force", "--no-progress"])
    return out


def dummy_model(work: Path, cfg: dict, precision: str | None, rac_channels: int) -> Path:
    """A model directory holding config.json alone, for ``--load-format dummy``; with a QUADS precision, the
    ``quantization_config`` its export would write, from the same plan (no producer: no manifest to verify)."""
    from transformers import Qwen3MoeConfig

    from quads_megatron.models import qwen3_moe
    from quads_megatron.plan import QuantPlan
    from quads_megatron.recipe import QuadsRecipe
    from quads_megatron.vocab import parse_precision

    out = work / f"dummy-{precision or 'bf16'}"
    conf = Qwen3MoeConfig(**cfg, torch_dtype="bfloat16")
    if precision is not None:
        recipe = QuadsRecipe(rollout_precision=parse_precision(precision), rac_channels=rac_channels)
        plan = QuantPlan.resolve(recipe, qwen3_moe.dims_from_hf_config(cfg))
        conf.quantization_config = plan.rollout_config().to_quantization_config()
    conf.save_pretrained(out)
    return out


@contextlib.contextmanager
def server(model: Path, quantization: str | None, log: Path, args, extra=()):
    """A running SGLang server on ``args.port`` (yields its URL), decode graphs up to ``args.max_bs``, then
    ``args.server_args`` and ``extra``; stopped and its GPU memory released on exit."""
    from quads_megatron.rl.engines.sglang_launch import SLIM_IMAGE_ARGS, SLIM_IMAGE_ENV, launch_server

    os.environ.update(SLIM_IMAGE_ENV)
    t0 = time.perf_counter()
    flags = SLIM_IMAGE_ARGS + SERVER_FLAGS + ["--cuda-graph-max-bs-decode", str(args.max_bs), *args.server_args,
                                              *extra]
    url, proc = launch_server(model, args.port, flags, log, quantization=quantization)
    print(f"  server {quantization or 'bf16'} on {model.name}: healthy after {time.perf_counter() - t0:.0f} s",
          flush=True)
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except Exception:
            proc.kill()
        time.sleep(3)


def local_engine(hf: Path, cfg: dict, precision: str, calib: dict, max_seq_len: int):
    """The local engine on the HF checkpoint's weights, calibrated on the exporter's prompts."""
    from safetensors.torch import load_file
    from transformers import Qwen3MoeConfig

    from quads_megatron.convert.calibration import random_prompts
    from quads_megatron.models import qwen3_moe
    from quads_megatron.plan import QuantPlan
    from quads_megatron.recipe import QuadsRecipe
    from quads_megatron.rl.engines.local import LocalEngine
    from quads_megatron.vocab import parse_precision

    recipe = QuadsRecipe(rollout_precision=parse_precision(precision), rac_channels=calib["rac_channels"])
    plan = QuantPlan.resolve(recipe, qwen3_moe.dims_from_hf_config(cfg))
    engine = LocalEngine(Qwen3MoeConfig(**cfg), plan, max_seq_len=max_seq_len, device=DEVICE)
    for f in sorted(hf.glob("*.safetensors")):
        engine.update_weights(load_file(str(f), device=DEVICE).items())
    if plan.rollout_precision.quantizes_activations:
        prompts = random_prompts(VOCAB, num_samples=calib["size"], seq_len=calib["seq_len"], seed=calib["seed"])
        engine.calibrate([p.tolist() for p in prompts])
    return engine


def greedy(engine, prompts, new_tokens: int):
    from quads_megatron.rl.engines.base import SamplingParams

    return engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=new_tokens), seed=0)


def agreement(a, b) -> dict:
    """Identical greedy sequences, first divergence, and log-prob differences over the common prefix."""
    same, diffs, first = 0, [], []
    for ra, rb in zip(a, b):
        n = next((i for i, (x, y) in enumerate(zip(ra.response_ids, rb.response_ids)) if x != y),
                 min(len(ra.response_ids), len(rb.response_ids)))
        same += ra.response_ids == rb.response_ids
        first.append(n)
        diffs += [abs(x - y) for x, y in zip(ra.logprobs[: n + 1], rb.logprobs[: n + 1])]
    diffs.sort()
    return {"prompts": len(a), "identical": same, "mean_first_divergence": sum(first) / len(first),
            "max_abs_logprob_diff": diffs[-1] if diffs else 0.0,
            "median_abs_logprob_diff": diffs[len(diffs) // 2] if diffs else 0.0}


def random_ids(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, length), generator=g).tolist()


def decode_rate(url: str, batch: int, in_len: int, out_len: int, seed: int) -> dict:
    """Decode tokens/s and ms per output token: (time for out_len tokens - time for 1 token) over out_len - 1 steps."""
    import requests

    ids = random_ids(batch, in_len, seed)

    def run(n):
        payload = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "ignore_eos": True, "temperature": 0.0}}
        t0 = time.perf_counter()
        r = requests.post(url + "/generate", json=payload, timeout=600)
        r.raise_for_status()
        return time.perf_counter() - t0

    run(out_len)  # warm-up
    t1 = min(run(1) for _ in range(2))
    tn = min(run(out_len) for _ in range(2))
    decode = max(tn - t1, 1e-9)
    return {"batch": batch, "tokens_per_s": batch * (out_len - 1) / decode, "ms_per_token": decode / (out_len - 1) * 1e3,
            "prefill_s": t1}


def save(result: dict, path: str) -> None:
    """Write what is measured so far (a stage cut short by the time limit keeps its finished rows)."""
    Path(path).write_text(json.dumps(result, indent=1))


def stage_agree(args, work, cfg, calib, result):
    from quads_megatron.rl.engines.sglang_http import SGLangEngine

    prompts = random_ids(args.num_prompts, args.prompt_len, seed=7)
    max_len = args.prompt_len + args.new_tokens
    rows = result.setdefault("agree", {})
    for p in args.precisions:
        ckpt = work / f"rollout-{p}"
        with server(ckpt, "quads", work / f"server-{p}.log", args) as url:
            srv = greedy(SGLangEngine([url], max_len), prompts, args.new_tokens)
            if args.throughput:
                result.setdefault("throughput", {})[f"quads {p}"] = [
                    decode_rate(url, b, args.in_len, args.out_len, seed=b) for b in args.batches]
        engine = local_engine(work / "hf", cfg, p, calib, max_len)
        rows[p] = agreement(srv, greedy(engine, prompts, args.new_tokens))
        del engine
        torch.cuda.empty_cache()
        print(f"  agree {p}: {rows[p]}", flush=True)
        save(result, args.out_json)


def stage_baselines(args, work, result):
    for name, quant in ((f"sglang {b}", BASELINE_QUANT[b]) for b in args.baselines):
        with server(work / "hf", quant, work / f"server-{name.split()[1]}.log", args) as url:
            result.setdefault("throughput", {})[name] = [
                decode_rate(url, b, args.in_len, args.out_len, seed=b) for b in args.batches]
        save(result, args.out_json)


def profile_decode(url: str, out_dir: Path, label: str, batch: int, in_len: int, steps: int) -> Path:
    """SGLang's profiler over ``steps`` decode steps of one ``batch`` (CUDA graphs replaying); the trace's path."""
    import requests

    requests.post(url + "/start_profile", timeout=60, json={
        "output_dir": str(out_dir), "num_steps": steps, "activities": ["GPU"], "profile_by_stage": True,
        "profile_stages": ["decode"], "with_stack": False, "record_shapes": False, "profile_prefix": label}).raise_for_status()
    payload = {"input_ids": random_ids(batch, in_len, seed=3),
               "sampling_params": {"max_new_tokens": steps + 8, "ignore_eos": True, "temperature": 0.0}}
    requests.post(url + "/generate", json=payload, timeout=600).raise_for_status()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        found = sorted(p for p in out_dir.glob(f"{label}-*.trace.json.gz") if "decode" in p.name.lower())
        if found:  # done once its size holds for 2 s (the profiler may still be writing it)
            size = found[0].stat().st_size
            time.sleep(2)
            if found[0].stat().st_size == size:
                return found[0]
            continue
        time.sleep(1)
    raise RuntimeError(f"no decode trace for {label} in {out_dir} after 120 s")


def kernel_summary(top: list, args) -> dict:
    """A profiled decode batch's record: GPU kernel time per step and the 25 largest kernels (calls, us per step)."""
    steps = args.profile_steps
    return {"batch": args.profile_batch, "kernel_us_per_step": sum(k.total_us for k in top) / steps,
            "top": [[k.name, k.calls / steps, k.total_us / steps] for k in top[:25]]}


def stage_profile(args, work, result):
    from quads_megatron.apps.study.trace import kernel_times, per_step_table

    servers = [("fp8", work / "hf", "fp8")] + [(p, work / f"rollout-{p}", "quads") for p in args.precisions]
    kernels, rows = {}, result.setdefault("profile", {})
    for label, ckpt, quant in servers:
        with server(ckpt, quant, work / f"server-profile-{label}.log", args) as url:
            rate = decode_rate(url, args.profile_batch, args.prompt_len, args.new_tokens, seed=args.profile_batch)
            trace = profile_decode(url, work / "traces", label, args.profile_batch, args.prompt_len,
                                   args.profile_steps)
        top = kernels[label] = kernel_times(trace)
        rows[label] = {"wall_ms_per_step": rate["ms_per_token"], **kernel_summary(top, args)}
        print(f"  profile {label}: {rate['ms_per_token']:.2f} ms per decode step at batch {args.profile_batch}",
              flush=True)
        save(result, args.out_json)
    print(per_step_table(kernels, args.profile_steps))


def stage_speed(args, work, cfg, result):
    """Every server on dummy weights: decode throughput at ``--batches``, then (``--profile-batch`` > 0) one
    profiled decode batch; the throughput table and the kernels per decode step, FP8 against each QUADS."""
    from quads_megatron.apps.study.trace import per_step_table

    quads = [(f"quads {p}", "quads", p) for p in args.precisions]
    baselines = [(f"sglang {b}", BASELINE_QUANT[b], None) for b in args.baselines]
    servers = quads[:1] + baselines + quads[1:]
    rows, prof, kernels = result.setdefault("speed", {}), result.setdefault("speed_profile", {}), {}
    for label, quant, precision in servers:
        tag = label.split()[1]
        log = work / f"server-speed-{tag}.log"
        try:
            rows[label], top = measure_speed(args, work, dummy_model(work, cfg, precision, args.rac_channels),
                                             quant, log, tag)
        except Exception as exc:  # one server failing (memory, start-up) leaves the others' rows
            result.setdefault("speed_errors", {})[label] = repr(exc)
            print(f"  {label} failed: {exc!r}; its log: {log}", flush=True)
            save(result, args.out_json)
            continue
        print(f"  {label}: " + ", ".join(f"B={r['batch']} {r['tokens_per_s']:.0f} tok/s" for r in rows[label]),
              flush=True)
        if top is not None:
            kernels[tag] = top
            prof[tag] = kernel_summary(top, args)
        save(result, args.out_json)
    print_throughput(rows)
    if kernels:
        print(per_step_table(kernels, args.profile_steps))


def measure_speed(args, work, model, quant, log, tag) -> tuple:
    """One dummy-weight server: (throughput rows at ``--batches``, its decode kernels at ``--profile-batch``
    or None)."""
    from quads_megatron.apps.study.trace import kernel_times

    with server(model, quant, log, args, extra=["--load-format", "dummy"]) as url:
        rows = [decode_rate(url, b, args.in_len, args.out_len, seed=b) for b in args.batches]
        if not args.profile_batch:
            return rows, None
        trace = profile_decode(url, work / "traces", f"speed-{tag}", args.profile_batch, args.in_len,
                               args.profile_steps)
    return rows, kernel_times(trace)


def layer_stream(src: Path, cfg: dict):
    """The HF checkpoint at ``src`` on the GPU as the GRPO job's layer stream: each layer's experts one
    ``ExpertsLayer`` of [E, 2F, H] / [E, H, F] stacks (as the trainer holds them), the rest as (name, tensor)."""
    from safetensors.torch import load_file

    from quads_megatron.plan import ExpertsLayer

    tensors = {k: v for f in sorted(src.glob("*.safetensors")) for k, v in load_file(str(f), device="cuda").items()}
    E = cfg["num_experts"]
    for layer in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{layer}.mlp.experts"
        fc1 = torch.stack([torch.cat([tensors.pop(f"{pre}.{e}.{p}.weight") for p in ("gate_proj", "up_proj")])
                           for e in range(E)])
        fc2 = torch.stack([tensors.pop(f"{pre}.{e}.down_proj.weight") for e in range(E)])
        yield ExpertsLayer(layer, fc1, fc2)
    yield from tensors.items()


def stage_update(args, work, cfg, calib, result):
    """w4a4 server: tensor sync to new weights, then disk sync back; each compared with a fresh server."""
    from transformers import Qwen3MoeConfig

    from quads_megatron.models import qwen3_moe
    from quads_megatron.plan import QuantPlan, quantize_named_params
    from quads_megatron.plan.named_params import flat_named
    from quads_megatron.recipe import QuadsRecipe
    from quads_megatron.rl.engines.sglang_http import SGLangEngine
    from quads_megatron.vocab import parse_precision

    p = "w4a4"
    prompts = random_ids(args.num_prompts, args.prompt_len, seed=7)
    max_len = args.prompt_len + args.new_tokens
    make_checkpoint(work / "hf2", args.num_layers, seed=2, scale=1.5)
    export(work / "hf2", work / f"rollout2-{p}", p, calib)
    with server(work / f"rollout2-{p}", "quads", work / "server-fresh2.log", args) as url:
        fresh2 = greedy(SGLangEngine([url], max_len), prompts, args.new_tokens)
    plan = QuantPlan.resolve(QuadsRecipe(rollout_precision=parse_precision(p)), qwen3_moe.dims_from_hf_config(cfg))
    out = {}
    with server(work / f"rollout-{p}", "quads", work / "server-update.log", args) as url:
        before = greedy(SGLangEngine([url], max_len), prompts, args.new_tokens)
        # per-expert names (SGLang's expert branch), back from disk, then whole-layer tensors (one loader call
        # per FusedMoE parameter): each compared with a fresh server on the same weights
        for name, mode, src in (("tensor", "tensor", work / "hf2"), ("disk", "disk", work / "hf"),
                                ("tensor stacked", "tensor", work / "hf2")):
            named = list(quantize_named_params(layer_stream(src, cfg), plan, keep_layers=True))
            nbytes = sum(t.numel() * t.element_size() for _, t in flat_named(named))
            engine = SGLangEngine([url], max_len, weight_sync=mode, sync_dir=str(work / "sync"),
                                  hf_config=Qwen3MoeConfig(**cfg), stacked_experts=name == "tensor stacked")
            assert engine.sends_stacked == (name == "tensor stacked"), "the server must run tp_size 1 with quads"
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.update_weights(named)
            seconds = time.perf_counter() - t0
            after = greedy(engine, prompts, args.new_tokens)
            want = fresh2 if mode == "tensor" else before
            out[name] = {"seconds": seconds, "gbytes": nbytes / 1e9, "gb_per_s": nbytes / 1e9 / seconds,
                         "vs_fresh_server": agreement(after, want)}
            print(f"  update {name}: {out[name]}", flush=True)
            del named
            torch.cuda.empty_cache()
    result["update"] = out


def print_throughput(rows: dict) -> None:
    if not rows:
        return
    batches = [r["batch"] for r in next(iter(rows.values()))]
    print("decode tokens/s (ms per output token)")
    print(f"{'':16}" + "".join(f"{'B=' + str(b):>20}" for b in batches))
    for name, rs in rows.items():
        print(f"{name:16}" + "".join(f"{r['tokens_per_s']:>11.0f} ({r['ms_per_token']:5.2f})" for r in rs))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stages", nargs="+", default=["agree", "baselines", "update"],
                    choices=["agree", "baselines", "update", "profile", "speed"])
    ap.add_argument("--num-layers", type=int, default=8)
    ap.add_argument("--precisions", nargs="+", default=list(QUADS_PRECISIONS), choices=QUADS_PRECISIONS)
    ap.add_argument("--work-dir", default="/tmp/quads-sglang")
    ap.add_argument("--out-json", required=True)
    ap.add_argument("--port", type=int, default=30011)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--no-throughput", dest="throughput", action="store_false",
                    help="agree stage: skip the decode-throughput measurement of the QUADS servers")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--in-len", type=int, default=128)
    ap.add_argument("--out-len", type=int, default=128)
    ap.add_argument("--max-bs", type=int, default=256, help="largest decode batch captured in a CUDA graph")
    ap.add_argument("--baselines", nargs="*", default=list(BASELINE_QUANT), choices=list(BASELINE_QUANT),
                    help="speed stage: SGLang's own servers timed with the QUADS ones (none: only QUADS; a stage "
                         "that does not fit one call's time runs in two calls on the same held machine)")
    ap.add_argument("--rac-channels", type=int, default=64)
    ap.add_argument("--profile-batch", type=int, default=64, help="profile stage: the decode batch")
    ap.add_argument("--profile-steps", type=int, default=16, help="profile stage: decode steps traced")
    ap.add_argument("--server-args", type=shlex.split, default=(),
                    help="more flags for every server, one string (e.g. '--disable-prefill-cuda-graph')")
    args = ap.parse_args(argv)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    calib = {"rac_channels": args.rac_channels, "size": 32, "seq_len": 128, "seed": 0}
    result = {"gpu": torch.cuda.get_device_name(), "num_layers": args.num_layers, "vocab": VOCAB, "args": vars(args)}
    t0 = time.perf_counter()
    cfg_path = work / "hf" / "config.json"
    if set(args.stages) <= {"speed"}:  # dummy weights: no checkpoint
        cfg = model_config(args.num_layers)
    elif cfg_path.exists() and json.loads(cfg_path.read_text())["num_hidden_layers"] == args.num_layers:
        cfg = {k: v for k, v in json.loads(cfg_path.read_text()).items() if k != "transformers_version"}
    else:
        cfg = make_checkpoint(work / "hf", args.num_layers, seed=1)
    for p in args.precisions if {"agree", "profile"} & set(args.stages) else []:
        if not (work / f"rollout-{p}" / "config.json").exists():
            export(work / "hf", work / f"rollout-{p}", p, calib)
    if "update" in args.stages and not (work / "rollout-w4a4" / "config.json").exists():
        export(work / "hf", work / "rollout-w4a4", "w4a4", calib)
    print(f"checkpoints ready after {time.perf_counter() - t0:.0f} s", flush=True)
    if "agree" in args.stages:
        stage_agree(args, work, cfg, calib, result)
    if "baselines" in args.stages:
        stage_baselines(args, work, result)
    if "update" in args.stages:
        stage_update(args, work, cfg, calib, result)
    if "profile" in args.stages:
        stage_profile(args, work, result)
    if "speed" in args.stages:
        stage_speed(args, work, cfg, result)
    save(result, args.out_json)
    print_throughput(result.get("throughput", {}))
    print(f"wrote {args.out_json} after {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
