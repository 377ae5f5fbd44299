"""--hf-checkpoint: the trainer starts from the HF weights (its log-probs equal the HF model's)."""

import torch

from quads_megatron.rl.arguments import parse_args
from quads_megatron.rl.loop import GRPOTrainer


def test_trainer_starts_from_hf_checkpoint(tiny_args, tmp_path):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from quads_megatron.megatron import hf_qwen3_moe_config_dict, qwen3_moe_config
    from quads_megatron.rl.tokenizer import build_char_tokenizer

    d = hf_qwen3_moe_config_dict(qwen3_moe_config("tiny"), 128, 16)
    d.pop("model_type")
    torch.manual_seed(7)
    hf = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**d), dtype=torch.float32).eval()  # fp32 compare
    hf.save_pretrained(tmp_path / "ck")
    build_char_tokenizer().save_pretrained(tmp_path / "ck")

    trainer = GRPOTrainer(parse_args(tiny_args("--hf-checkpoint", str(tmp_path / "ck"), "--train-precision", "bf16",
                                               "--rollout-precision", "bf16")))
    trainer.policy.load_hf_checkpoint()
    tokens = torch.tensor([[2, 5, 6, 7, 8, 9, 10, 11]])
    with torch.no_grad():
        ours, _ = trainer.policy.token_logprobs(tokens)
        ref = torch.log_softmax(hf(tokens).logits[:, :-1].float(), -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    trainer.close()
    assert torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()
    assert parse_args(["--hf-checkpoint", str(tmp_path / "ck")]).sft_iters == 0  # no synthetic warm-up by default
