"""Rollout routing replay (R3) in the trainer: Megatron's routers dispatch the rollout's top-k experts of every
token, still differentiate their gate probabilities, and the disagreement metric counts what differs.

The check of what the router dispatched is its own output (TopKRouter's routing_map), read by a forward hook,
independent of the replay code that sets it up.
"""

import pytest
import torch

from quads_megatron.rl.arguments import parse_args
from quads_megatron.rl.batch import build_train_batch, encode_prompt
from quads_megatron.rl.engines.base import SamplingParams
from quads_megatron.rl.loop import GRPOTrainer


def _trainer(tiny_args, rollout_precision):
    t = GRPOTrainer(parse_args(tiny_args("--train-precision", "bf16", "--rollout-precision", rollout_precision,
                                         "--max-new-tokens", "6")))
    t.sync_weights()
    return t


def _batch(t, n=6, seed=0):
    samples = t.task.train_batch(n, seed=seed)
    prompts = [encode_prompt(t.tokenizer, s.prompt) for s in samples]
    rollouts = t.engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=6), seed=seed)
    return rollouts, build_train_batch(rollouts, torch.zeros(n), t.pad)


class _DispatchSpy:
    """The routing_map [s*b, E] each TopKRouter returned in the last forward, per MoE layer."""

    def __init__(self, model):
        from quads_megatron.megatron.routing_replay import moe_routers

        self.maps = {}
        self.handles = [r.register_forward_hook(self._hook(layer)) for layer, r in moe_routers(model)]

    def _hook(self, layer):
        def f(mod, inputs, out):
            self.maps[layer] = out[1].detach()
        return f

    def experts(self, layer, batch):
        """Sorted expert ids [B, S, K] per token, back in batch-first order."""
        m = self.maps[layer]
        ids = m.nonzero()[:, 1].view(m.shape[0], -1)  # nonzero is row-major: each row's experts ascending
        return ids.view(-1, batch, ids.shape[-1]).transpose(0, 1)


def _fed_rows(rollouts):
    return [len(r.prompt_ids) + len(r.response_ids) - 1 for r in rollouts]


def test_replay_makes_the_trainer_dispatch_the_rollouts_experts_for_every_token(tiny_args):
    """BF16 rollout of a BF16 trainer with replay on: every fed token of every layer goes to the rollout's top-k."""
    t = _trainer(tiny_args, "bf16")
    rollouts, batch = _batch(t)
    spy = _DispatchSpy(t.policy.model)
    with torch.no_grad():
        t.policy.token_logprobs(batch.tokens, routes=batch.routes, replay=True)
    for layer in spy.maps:
        got = spy.experts(layer, len(batch))
        for i, (r, rows) in enumerate(zip(rollouts, _fed_rows(rollouts))):
            want = r.routed_experts[:, layer].long().sort(-1).values
            assert torch.equal(got[i, :rows], want), f"sample {i} layer {layer}"
    t.close()


def test_replay_of_the_trainers_own_routes_changes_nothing_and_still_trains_the_gate(tiny_args):
    """Replaying the routes the trainer would choose itself gives the same log-probs and the same gradients,
    router weight included (the gate probabilities of the replayed experts are differentiated)."""
    t = _trainer(tiny_args, "bf16")
    rollouts, batch = _batch(t, seed=1)
    model = t.policy.model
    with torch.no_grad():
        t.policy.token_logprobs(batch.tokens, routes=batch.routes)  # record the trainer's own top-k
    spy = _DispatchSpy(model)
    with torch.no_grad():
        t.policy.token_logprobs(batch.tokens)
    own = torch.stack([spy.experts(layer, len(batch)) for layer in sorted(spy.maps)], 2).to(torch.int32)

    def grads(replay):
        model.zero_grad(set_to_none=True)
        lp, _ = t.policy.token_logprobs(batch.tokens, routes=own if replay else None, replay=replay)
        (lp * batch.mask).sum().backward()
        return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    lp_free, g_free = grads(False)
    lp_replay, g_replay = grads(True)
    assert torch.equal(lp_free, lp_replay)
    routers = [n for n in g_free if n.endswith("router.weight")]
    assert routers and all(g_replay[n].abs().sum() > 0 for n in routers)
    assert g_free.keys() == g_replay.keys()
    for n in g_free:
        torch.testing.assert_close(g_replay[n], g_free[n], rtol=0, atol=0, msg=n)
    assert not t.policy.last_routing_diff.any()  # own routes: no disagreement
    t.close()


def test_a_rollout_that_routes_differently_is_counted_and_replayed(tiny_args):
    """A rollout whose routers differ (its gate weights perturbed, as a low-precision rollout's would be) routes
    some tokens elsewhere: the disagreement counts them (checked by hand against the trainer's free routing),
    and under replay the trainer dispatches the rollout's experts anyway."""
    t = _trainer(tiny_args, "bf16")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in t.engine.model.model.layers:
            w = layer.mlp.gate.weight
            w.add_(torch.randn(w.shape, generator=gen) * w.std())
    rollouts, batch = _batch(t, n=8, seed=2)
    spy = _DispatchSpy(t.policy.model)
    with torch.no_grad():
        t.policy.token_logprobs(batch.tokens, routes=batch.routes, replay=False)
    diff = t.policy.last_routing_diff
    free = torch.stack([spy.experts(layer, len(batch)) for layer in sorted(spy.maps)], 2)
    rollout = batch.routes.long().sort(-1).values
    by_hand = (free != rollout).any(-1)[:, :-1]  # [B, S-1, L]
    m = batch.mask.bool()
    assert torch.equal(diff[m], by_hand[m])
    assert 0 < int(diff[m].sum()) < diff[m].numel(), "the test needs some, not all, tokens routed differently"
    with torch.no_grad():
        t.policy.token_logprobs(batch.tokens, routes=batch.routes, replay=True)
    assert torch.equal(t.policy.last_routing_diff[m], diff[m])  # replay reports what the router would have chosen
    for layer in spy.maps:
        got = spy.experts(layer, len(batch))
        for i, rows in enumerate(_fed_rows(rollouts)):
            assert torch.equal(got[i, :rows], rollout[i, :rows, layer])
    t.close()


def test_router_order_is_s_major_and_sequence_parallel_takes_this_ranks_chunk():
    from quads_megatron.megatron.routing_replay import to_router_order

    B, S = 2, 4
    routes = torch.tensor([[[10 * b + s, 100 + 10 * b + s] for s in range(S)] for b in range(B)])  # [B, S, K]
    flat = to_router_order(routes)
    # Megatron's router: hidden [s, b, h] viewed as [s * b, h]: token index s * B + b
    assert flat[:, 0].tolist() == [0, 10, 1, 11, 2, 12, 3, 13]
    rank1 = to_router_order(routes, tp_rank=1, tp_size=2, sequence_parallel=True)
    assert rank1[:, 0].tolist() == [2, 12, 3, 13] and rank1.dtype == torch.int64


@pytest.mark.parametrize("replay", [False, True])
def test_grpo_logs_routing_disagreement(tiny_args, tmp_path, replay):
    import json

    from quads_megatron.rl.loop import main

    flags = tiny_args("--train-iters", "2", "--rollout-precision", "w4a4", "--train-precision", "bf16",
                      "--global-batch-size", "8")
    out = main(flags + (["--use-rollout-routing-replay"] if replay else []))
    vals = [h["routing_disagreement"] for h in out["history"]]
    assert len(vals) == 2 and all(0 <= v <= 1 for v in vals)
    saved = json.loads((tmp_path / "tb" / "summary.json").read_text())
    assert saved["rollout_routing_replay"] is replay and saved["mean_routing_disagreement"] == pytest.approx(
        sum(vals) / 2)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert len(acc.Scalars("mismatch/routing_disagreement")) == 2
    assert len(acc.Scalars("mismatch/routing_disagreement_any_layer")) == 2
