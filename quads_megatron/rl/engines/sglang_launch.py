"""Start an SGLang `--quantization quads` server for the run: export the trainer's weights, launch, wait for health."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch.distributed as dist

from .sglang_http import SGLangError

# SGLang 0.5.23 on a Hopper image without FlashInfer, FA3 or a torch-2.14 build of its Rust radix tree
# (the slimmed wheel set of tools/sglang_wheelhouse.sh; docs/sglang-hopper.md says why each is needed).
SLIM_IMAGE_ENV = {"SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1", "SGLANG_IS_FLASHINFER_AVAILABLE": "false",
                  "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python"}
SLIM_IMAGE_ARGS = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none"]

# What torchrun exports to its workers. The server is its own distributed program: with these inherited, torch
# < 2.14 makes its process-group rendezvous a client of the torchrun agent's store (TORCHELASTIC_USE_AGENT_STORE)
# at an address nobody serves, and the server hangs at "Init parallel begin" (seen on the H100 image, torch 2.11).
LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


def server_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) without the torchrun launch variables, for the server's process."""
    env = dict(os.environ if env is None else env)
    return {k: v for k, v in env.items() if k not in LAUNCHER_ENV and not k.startswith("TORCHELASTIC_")}


def export_rollout_checkpoint(policy, tokenizer, out_dir: str | os.PathLike,
                              calib_prompts: list[str] | None = None) -> Path:
    """Write the live model as an HF checkpoint, then the QUADS NVFP4 rollout checkpoint of it (collective).

    Every rank runs the weight gather; rank 0 writes `out_dir/hf` (in the trainer's dtype, so the
    exported NVFP4 bytes are the trainer's) and `out_dir/rollout` with the run's recipe (rollout
    precision, scaling, RAC channels). RAC channels and activation scales are calibrated on
    calib_prompts (the task's prompts), else random tokens.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    tensors = {}
    for name, t in policy.hf_weights():
        if rank0:
            tensors[name] = t.detach().cpu().contiguous()
    if rank0:
        from quads_megatron.convert.rollout_export import export_rollout
        from quads_megatron.output_dir import atomic_output_dir

        hf = out / "hf"
        with atomic_output_dir(hf, force=True, flag="--tensorboard-dir") as tmp:
            save_file(tensors, str(tmp / "model.safetensors"))
            cfg = policy.hf_config()
            cfg.eos_token_id, cfg.bos_token_id, cfg.pad_token_id = (tokenizer.eos_token_id, tokenizer.bos_token_id,
                                                                    tokenizer.pad_token_id)
            cfg.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            (tmp / "quads_recipe.json").write_text(policy.recipe.to_json())
        calib = {}
        if calib_prompts:
            (out / "calib.txt").write_text("\n".join(p.replace("\n", " ") for p in calib_prompts) + "\n")
            calib = dict(calib_data=out / "calib.txt", calib_size=len(calib_prompts), calib_seq_len=policy.max_seq_len)
        export_rollout(hf, out / "rollout", fmt="quads", force=True, progress=False, **calib)
    if dist.is_initialized():
        dist.barrier()
    return out / "rollout"


def launch_server(model_path: str | os.PathLike, port: int, extra_args: list[str], log_path: str | os.PathLike,
                  timeout_s: float = 900.0, quantization: str | None = "quads") -> tuple[str, subprocess.Popen]:
    """Run `python -m sglang.launch_server --quantization quads --enable-return-routed-experts`; return (url,
    process) once /health answers.

    quantization: SGLang's --quantization value; None serves the checkpoint as it is (the BF16 baseline).
    """
    import requests

    quant = ["--quantization", quantization] if quantization else []
    if "--enable-return-routed-experts" not in extra_args:  # the rollout's top-k ids (routing replay, disagreement)
        quant.append("--enable-return-routed-experts")
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path), *quant,
           "--host", "127.0.0.1", "--port", str(port), *extra_args]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=server_env())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.close()
            tail = Path(log_path).read_text()[-3000:]
            raise SGLangError(f"SGLang server exited with code {proc.returncode} before becoming healthy "
                              f"(command: {' '.join(cmd)}); last log lines from {log_path}:\n{tail}")
        try:
            if requests.get(url + "/health", timeout=5).status_code == 200:
                return url, proc
        except requests.exceptions.RequestException:
            pass
        time.sleep(2.0)
    proc.terminate()
    raise SGLangError(f"SGLang server at {url} not healthy after {timeout_s:.0f} s; see {log_path}")
