"""A GRPO --save directory converts with quads-convert-megatron-to-hf, and transformers reproduces the trainer.

The expectation is independent of the converter: the trainer's master weights (unquantized, fp32 on
CPU) run through a plain Megatron GPTModel give the logits that transformers computes from the
converted checkpoint, and the embedding/head/norm tensors are the trainer's bit for bit.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from tiny_flags import TINY

from quads_megatron.convert import megatron_to_hf
from quads_megatron.megatron import checkpoint as mckpt
from quads_megatron.rl.arguments import parse_args
from quads_megatron.rl.loop import GRPOTrainer

LOGITS_ATOL = 1e-5  # fp32 on both sides: only the summation order differs
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_grpo_moe.sh"


def _master_logits(policy, ids):
    """Logits of the trainer's master weights (the AQAT wrapper would fake-quantize the experts)."""
    from quads_megatron.megatron import build_gpt_model

    plain = build_gpt_model(policy.config, policy.padded_vocab_size, policy.max_seq_len, rotary_base=policy.rotary_base,
                            share_embeddings_and_output_weights=policy.tie_word_embeddings)
    plain.load_state_dict(policy.model.state_dict())
    with torch.no_grad():
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        return plain.eval()(ids, pos, None)[..., : policy.vocab_size].float()


def _hf_logits(hf_dir, ids):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(ids).logits


def test_grpo_save_dir_converts_to_hf(tiny_args, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quads_megatron.megatron.aqat import quads_recipe
    from quads_megatron.recipe import QuadsRecipe

    save, out = tmp_path / "ck", tmp_path / "hf"
    trainer = GRPOTrainer(parse_args(tiny_args("--train-iters", "2", "--save", str(save), "--save-interval", "1")))
    try:
        trainer.run()
    finally:
        trainer.close()
    policy = trainer.policy
    assert mckpt.latest_iteration(save) == 2 and (save / "iter_0000001").is_dir()
    megatron_to_hf.main(["--load-dir", str(save), "--save-dir", str(out), "--no-progress"])

    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    sd = hf.state_dict()
    V = policy.vocab_size
    masters = policy.model.state_dict()
    assert torch.equal(sd["model.embed_tokens.weight"], masters["embedding.word_embeddings.weight"][:V])
    assert torch.equal(sd["lm_head.weight"], masters["output_layer.weight"][:V])
    assert torch.equal(sd["model.norm.weight"], masters["decoder.final_layernorm.weight"])
    ids = (torch.arange(2 * policy.max_seq_len).reshape(2, -1) * 7 + 3) % V
    with torch.no_grad():
        theirs = hf(ids).logits
    torch.testing.assert_close(theirs, _master_logits(policy, ids), rtol=0, atol=LOGITS_ATOL)  # iteration 2's weights
    # the recipe and the tokenizer travel with it
    assert QuadsRecipe.from_json((out / "quads_recipe.json").read_text()) == quads_recipe(policy.model)
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.encode("3 1 2", add_special_tokens=False) == trainer.tokenizer.encode("3 1 2", add_special_tokens=False)

    # a checkpoint without a stored HF config takes config.json from the save directory's hf/
    bare = tmp_path / "bare"
    mckpt.save_iteration(policy.model, bare, 7)
    shutil.copytree(save / "hf", bare / "hf")
    megatron_to_hf.main(["--load-dir", str(bare), "--save-dir", str(tmp_path / "hf2"),
                         "--no-progress"])
    hf2 = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf2"), dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(hf2(ids).logits, theirs)


def test_two_rank_checkpoint_converts_and_resumes_on_one_rank(tiny_args, tmp_path):
    """EP=2 (torchrun, gloo) saves; one process converts it and resumes from it (weights and AdamW resharded)."""
    save, out = tmp_path / "ck", tmp_path / "hf"
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1")
    env.pop("NPROC_PER_NODE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(EXAMPLE),
           "--expert-model-parallel-size", "2", "--train-iters", "2", "--save", str(save), *TINY,
           "--tensorboard-dir", str(tmp_path / "tb")]
    r = subprocess.run(cmd, cwd=EXAMPLE.parents[1], env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert mckpt.latest_iteration(save) == 2
    megatron_to_hf.main(["--load-dir", str(save), "--save-dir", str(out), "--no-progress"])

    trainer = GRPOTrainer(parse_args(tiny_args("--train-iters", "3", "--save", str(save), "--resume")))
    try:
        policy = trainer.policy
        state = policy.load_checkpoint(save)
        assert state["iteration"] == 2 and state["rank_state"] is None  # RNG: saved by another layout
        ids = (torch.arange(2 * policy.max_seq_len).reshape(2, -1) * 5 + 1) % policy.vocab_size
        torch.testing.assert_close(_hf_logits(out, ids), _master_logits(policy, ids), rtol=0, atol=LOGITS_ATOL)
        # AdamW resharded EP=2 -> 1: every saved moment element lands on exactly one parameter
        from megatron.core.dist_checkpointing import load_plain_tensors

        opt = policy.optimizer.state_dict()["state"]
        assert len(opt) == len(list(policy.model.parameters())) and all(float(s["step"]) == 2 for s in opt.values())
        plain = load_plain_tensors(str(save / "iter_0000002"))
        for key in ("exp_avg", "exp_avg_sq"):
            saved = sum(v.double().abs().sum() for k, v in plain.items() if k.startswith(f"optimizer.state.{key}."))
            loaded = sum(s[key].double().abs().sum() for s in opt.values())
            assert saved > 0 and torch.isclose(loaded, saved, rtol=1e-9, atol=0), key
        summary = trainer.run()
    finally:
        trainer.close()
    assert summary["steps"] == 3 and mckpt.latest_iteration(save) == 3
    args = json.loads(mckpt.load_common_state(save)[GRPOTrainer.LOOP_STATE_KEY]["args"])
    assert args["expert_model_parallel_size"] == 1 and args["resume"]
