"""The HF <-> Megatron Qwen3-MoE table: on-disk HF names, QKV interleave, gate/up stacking, TP sharding."""

import torch

from quads_megatron.models import qwen3_moe


def _qkv_rule():
    return next(r for r in qwen3_moe.RULES if r.layout == "qkv")


def test_qkv_is_interleaved_per_query_group_as_megatron_splits_it():
    dims = qwen3_moe.Dims(vocab_size=8, hidden_size=4, num_layers=1, num_heads=6, num_kv_heads=2, head_dim=3,
                          num_experts=2, moe_ffn=4, tie_word_embeddings=False)
    D, H = dims.head_dim, dims.hidden_size
    # tag every row: kind*1000 + head*10 + row-in-head
    tag = lambda kind, heads: torch.tensor([[kind * 1000 + h * 10 + d] * H for h in range(heads) for d in range(D)],
                                           dtype=torch.float32)
    q, k, v = tag(1, 6), tag(2, 2), tag(3, 2)
    qkv = qwen3_moe.to_megatron(_qkv_rule(), [q, k, v], dims)
    # Megatron: view [ng, (np/ng + 2) * hn], split [np/ng*hn, hn, hn] (SelfAttention.get_query_key_value_tensors)
    grouped = qkv[:, 0].reshape(dims.num_kv_heads, -1)
    mq, mk, mv = grouped.split([dims.heads_per_group * D, D, D], dim=1)
    for g in range(dims.num_kv_heads):
        heads = sorted({int(x) // 10 % 100 for x in mq[g]})
        assert heads == list(range(g * dims.heads_per_group, (g + 1) * dims.heads_per_group))
        assert {int(x) // 10 % 100 for x in mk[g]} == {g} and {int(x) // 10 % 100 for x in mv[g]} == {g}
    back = qwen3_moe.to_hf(_qkv_rule(), qkv, dims)
    assert all(torch.equal(a, b) for a, b in zip(back, [q, k, v]))


def test_gate_up_tp_shards_match_the_trainers_expert_shards():
    from quads_megatron.megatron.model import expert_shards

    rule = next(r for r in qwen3_moe.RULES if r.layout == "gate_up")
    down = next(r for r in qwen3_moe.RULES if r.expert and r.layout == "copy")
    fc1, fc2 = torch.randn(16, 8), torch.randn(8, 8)
    pieces = [qwen3_moe.shard(rule, fc1, r, 2) for r in range(2)]
    for r in range(2):
        ref1, ref2 = expert_shards(fc1, fc2, r, 2)
        assert torch.equal(pieces[r], ref1) and torch.equal(qwen3_moe.shard(down, fc2, r, 2), ref2)
    assert torch.equal(qwen3_moe.unshard(rule, pieces), fc1)


def test_te_spec_names_map_to_the_local_spec_rules():
    rule, layer, expert = qwen3_moe.match_megatron("decoder.layers.3.mlp.experts.linear_fc1.weight7")
    assert (rule.layout, layer, expert) == ("gate_up", 3, 7)
    rule, layer, _ = qwen3_moe.match_megatron("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight")
    assert qwen3_moe.hf_names(rule, layer) == ["model.layers.0.input_layernorm.weight"]
    assert qwen3_moe.match_megatron("decoder.layers.0.mlp.shared_experts.linear_fc1.weight") is None
