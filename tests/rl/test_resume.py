"""Checkpoint/resume: the resumed run's next step is identical; a crash mid-step keeps the last checkpoint."""

import pytest
import torch

from quads_megatron.rl import checkpoint as ckpt
from quads_megatron.rl.loop import GRPOTrainer, main
from quads_megatron.rl.arguments import parse_args


def _final_state(save_dir, it):
    return torch.load(save_dir / f"iter_{it:07d}" / "mp_rank_00_000" / "model_optim_rng.pt", weights_only=False)


def test_resume_gives_identical_next_step(tiny_args, tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    a = main(tiny_args("--train-iters", "3", "--save", str(full), "--save-interval", "2", tb="a"))
    main(tiny_args("--train-iters", "2", "--save", str(part), "--save-interval", "2", tb="b"))
    b = main(tiny_args("--train-iters", "3", "--save", str(part), "--save-interval", "2", "--resume", tb="b"))
    assert ckpt.latest_iteration(full) == ckpt.latest_iteration(part) == 3
    assert (full / "hf" / "config.json").is_file() and (full / "hf" / "tokenizer.json").is_file()
    assert a["history"][2] == b["history"][2]  # step 3: same reward, log-prob gap, pass@1
    sa, sb = _final_state(full, 3)["policy"], _final_state(part, 3)["policy"]
    for k, v in sa["model"].items():
        if torch.is_tensor(v):
            assert torch.equal(v, sb["model"][k]), k
    assert sa["optimizer"]["state"][0]["step"] == sb["optimizer"]["state"][0]["step"]


def test_crash_mid_step_keeps_last_checkpoint(tiny_args, tmp_path, monkeypatch):
    save = tmp_path / "ck"
    trainer = GRPOTrainer(parse_args(tiny_args("--train-iters", "4", "--save", str(save), "--save-interval", "1", "--eval-interval", "100")))
    real = trainer.engine.generate
    calls = {"n": 0}

    def flaky(prompts, params, seed):
        calls["n"] += 1
        if calls["n"] == 4:  # 1 = pass@1 before GRPO, 2-3 = steps 1-2, 4 = step 3
            raise RuntimeError("rollout server died")
        return real(prompts, params, seed)

    monkeypatch.setattr(trainer.engine, "generate", flaky)
    with pytest.raises(RuntimeError, match="rollout server died"):
        trainer.run()
    trainer.close()
    assert ckpt.latest_iteration(save) == 2
    assert not list(save.glob("*.tmp"))
    state = ckpt.load_checkpoint(save)
    assert state["iteration"] == 2 and "model" in state["policy"]
