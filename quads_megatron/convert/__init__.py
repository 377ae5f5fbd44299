"""Checkpoint conversion Megatron <-> Hugging Face <-> QUADS NVFP4 rollout format (Qwen3-MoE).

* ``hf_checkpoint``: validating safetensors reader, streaming sharded writer.
* ``qwen3_moe``: the HF <-> Megatron name/layout table (why not a bridge library: its docstring).
* ``hf_to_megatron_weights`` / ``megatron_checkpoint``: HF -> live Megatron model -> torch_dist.
* ``live.iter_hf_weights``: (HF name, tensor) from a live model, TP/EP shards gathered.
* ``rollout_export``: HF -> QUADS / ModelOpt NVFP4 rollout checkpoint.
"""

from quads_megatron.errors import CheckpointError

__all__ = ["CheckpointError", "iter_hf_weights"]


def __getattr__(name):
    # Lazy: ``iter_hf_weights`` pulls in torch.distributed helpers only when used.
    if name == "iter_hf_weights":
        from quads_megatron.convert.live import iter_hf_weights

        return iter_hf_weights
    raise AttributeError(name)
