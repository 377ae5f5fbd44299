"""GRPO for MoE LLMs with a Megatron-Core trainer and NVFP4 (QUADS) rollouts.

Run it with `torchrun examples/train_grpo_moe.sh [flags]` (or `python -m quads_megatron.rl`).

* `loop`: the job (`GRPOTrainer`, `main`): rollout -> reward -> advantages -> update -> weight sync.
* `arguments`: Megatron/slime-style flags.   `policy`: the Megatron-Core model, log-probs, optimizer.
* `engines`: `RolloutEngine` + `LocalEngine` (HF Qwen3-MoE, KV cache, NVFP4 kernels per
  `--rollout-precision`) + `SGLangEngine` (HTTP, several servers or a router).
* `tasks` (verifiable rewards), `tokenizer` (char-level default), `advantages`, `loss` (PPO clip,
  TIS, token MIS, k3 KL), `batch`, `metrics` (TensorBoard + compact line).
"""
