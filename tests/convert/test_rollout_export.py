"""HF -> QUADS / ModelOpt NVFP4 rollout checkpoints: exact trainer view, ModelOpt decoding, configs, calibration.

Everything is driven through the CLI (``rollout_export.main``) and read back from the files it
writes. The calibration expectations (input_scale, RAC channels) come from a reference written
here from the definitions (quads_megatron/rac.py, the paper, the rule of quads_megatron.plan.calibration:
the model as served): the HF model itself in fp32 with its expert weights replaced by their NVFP4
fake-quantized values, its MoE-block inputs and router choices captured with forward hooks, gives
fc1/fc2 amax (fc2: the tokens routed to each expert, one max over the layer) and the per-channel
E[(x - xq)^2] * ||Wq[:, c]||^2 score whose top k the exporter must store.
"""

import json

import pytest
import torch
import torch.nn.functional as Fn

from quads_megatron import nvfp4
from quads_megatron.convert import rollout_export
from quads_megatron.models import qwen3_moe
from quads_megatron.convert.hf_checkpoint import HFCheckpoint
from quads_megatron.nvfp4 import NVFP4Tensor

K = 16
SEQ = 16
PROMPTS = ["What is 12 + 30? Think step", "Sort the list 3 1 2 9 7 5 4", "The quick brown fox jumps",
           "def f(x): return x * x + 1"]


def _char_tokenizer(path):
    """A character-level fast tokenizer (ids < 96 fit the tiny vocabulary), built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(i): i - 32 for i in range(32, 127)} | {"[UNK]": 95}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def calib_flags(tmp_path_factory):
    """CLI flags calibrating on PROMPTS (whose token ids the test knows: ord(c) - 32, first SEQ)."""
    root = tmp_path_factory.mktemp("calib")
    data = root / "calib.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in PROMPTS))
    return ["--calib-data", str(data), "--tokenizer-dir", str(_char_tokenizer(root / "tok")),
            "--calib-size", str(len(PROMPTS)), "--calib-seq-len", str(SEQ), "--no-progress"]


def _prompt_ids():
    return [torch.tensor([ord(c) - 32 for c in t[:SEQ]]) for t in PROMPTS]


@pytest.fixture(scope="module")
def quads_ckpt(tiny_hf, calib_flags, tmp_path_factory):
    out = tmp_path_factory.mktemp("rollout") / "quads"
    rollout_export.main(["--load-dir", str(tiny_hf), "--save-dir", str(out), "--rac-channels", str(K), *calib_flags])
    return out


@pytest.fixture(scope="module")
def modelopt_ckpt(tiny_hf, calib_flags, tmp_path_factory):
    out = tmp_path_factory.mktemp("rollout") / "modelopt"
    rollout_export.main(["--load-dir", str(tiny_hf), "--save-dir", str(out), "--format", "modelopt", *calib_flags])
    return out


def _fake_quantized_experts(gate, up, down):
    """The expert weights the rollout GEMMs multiply (fp32): gate/up of an expert share one global scale."""
    E = gate.shape[0]
    shared = [torch.maximum(gate[e].abs().max(), up[e].abs().max()) for e in range(E)]
    gq = torch.stack([nvfp4.fake_quantize(gate[e], amax=shared[e]) for e in range(E)])
    uq = torch.stack([nvfp4.fake_quantize(up[e], amax=shared[e]) for e in range(E)])
    dq = torch.stack([nvfp4.fake_quantize(down[e]) for e in range(E)])
    return gq, uq, dq


@pytest.fixture(scope="module")
def reference(tiny_hf):
    """Per MoE layer, from the model as served run on PROMPTS one at a time (the HF model in fp32, expert
    weights NVFP4 fake-quantized): x [T, H] (the MoE block's input), the router's top-k experts [T, topk],
    and the fake-quantized expert weights (fp32) computed from the source files."""
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(str(tiny_hf), dtype=torch.float32).eval()
    weights = {}
    with HFCheckpoint(tiny_hf) as src:
        dims = qwen3_moe.dims_from_hf_config(src.config)
        for i in range(dims.num_layers):
            p = f"model.layers.{i}.mlp.experts."
            w = {n: torch.stack([src.get(f"{p}{e}.{n}_proj.weight").float() for e in range(dims.num_experts)])
                 for n in ("gate", "up", "down")}
            weights[i] = dict(zip(("gate", "up", "down"), _fake_quantized_experts(w["gate"], w["up"], w["down"])))
            experts = model.model.layers[i].mlp.experts
            with torch.no_grad():
                experts.gate_up_proj.copy_(torch.cat([weights[i]["gate"], weights[i]["up"]], dim=1))
                experts.down_proj.copy_(weights[i]["down"])
    xs, routes, hooks = {}, {}, []
    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.mlp.register_forward_pre_hook(
            lambda m, a, i=i: xs.setdefault(i, []).append(a[0].reshape(-1, a[0].shape[-1]).float())))
        hooks.append(layer.mlp.gate.register_forward_hook(
            lambda m, a, out, i=i: routes.setdefault(i, []).append(out[-1])))
    with torch.no_grad():
        for ids in _prompt_ids():
            model(ids[None])
    for h in hooks:
        h.remove()
    out = {i: dict(x=torch.cat(xs[i]), topk=torch.cat(routes[i]), **weights[i]) for i in weights}
    assert out[0]["x"].shape[0] == len(PROMPTS) * SEQ
    return out


def _mean_sq_err(x, amax=None):
    """E_t[(x - xq)_c^2]: NVFP4 activation error per channel, per-token scale (or a static amax)."""
    xq = nvfp4.fake_quantize(x, per_row=True) if amax is None else nvfp4.fake_quantize(x, amax=amax)
    return (x - xq).double().square().mean(0)


def _expected_layer(ref, static=False):
    """(fc1 amax, fc2 amax, fc1 score [H], fc2 score [E, F]) of one layer, from the definitions."""
    x, topk, gate, up, down = ref["x"], ref["topk"], ref["gate"], ref["up"], ref["down"]   # fake-quantized weights
    E = gate.shape[0]
    fc1_amax = x.abs().max()
    routed = [(topk == e).any(-1) for e in range(E)]
    h = [Fn.silu(x[r] @ gate[e].T) * (x[r] @ up[e].T) for e, r in enumerate(routed)]  # fc2 input, routed tokens
    fc2_amax = torch.stack([he.abs().max() for he in h if he.numel()]).max()  # one static scale for the layer
    # fc1: one set per layer (all experts read x): error of x times the column norms summed over experts
    fc1 = _mean_sq_err(x, fc1_amax if static else None) * sum(torch.cat([gate[e], up[e]]).double().square().sum(0)
                                                               for e in range(E))
    errs = [(he - (nvfp4.fake_quantize(he, per_row=True) if not static else nvfp4.fake_quantize(he, amax=fc2_amax)))
            .double().square() for he in h]
    pooled = torch.cat(errs).mean(0)  # an expert no token reached: the layer's pooled fc2 statistics
    fc2 = [(err.mean(0) if err.shape[0] else pooled) * down[e].double().square().sum(0) for e, err in enumerate(errs)]
    return fc1_amax, fc2_amax, fc1, torch.stack(fc2)


def _assert_top_k(idx, score, k, what):
    """idx holds k of the highest-scoring channels (sorted int32); near-ties at the cut may go either way."""
    assert idx.dtype == torch.int32 and idx.shape == (k,), what
    assert bool((idx[1:] > idx[:-1]).all()), what
    inside = torch.zeros_like(score, dtype=torch.bool)
    inside[idx.long()] = True
    lo, hi = float(score[inside].min()), float(score[~inside].max())
    assert lo >= hi * (1 - 1e-4), f"{what}: a channel of score {hi:.4g} is left out for one of {lo:.4g}"


def _expert_bases(dims):
    for layer in range(dims.num_layers):
        for e in range(dims.num_experts):
            yield layer, e, f"model.layers.{layer}.mlp.experts.{e}."


def _nvfp4(ckpt, base):
    return NVFP4Tensor.from_modelopt(ckpt.get(base + ".weight"), ckpt.get(base + ".weight_scale"),
                                     ckpt.get(base + ".weight_scale_2"), name=base)


def test_nvfp4_weights_dequantize_to_the_trainers_fake_quantize(tiny_hf, quads_ckpt):
    with HFCheckpoint(tiny_hf) as src, HFCheckpoint(quads_ckpt) as out:
        dims = qwen3_moe.dims_from_hf_config(src.config)
        for _layer, _e, p in _expert_bases(dims):
            gate, up, down = (src.get(p + n) for n in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"))
            shared = nvfp4.shared_amax([gate, up])
            for proj, w, amax in (("gate_proj", gate, shared), ("up_proj", up, shared), ("down_proj", down, None)):
                q = _nvfp4(out, p + proj)
                assert torch.equal(q.dequantize(torch.bfloat16), nvfp4.fake_quantize(w, amax=amax)), p + proj
                assert torch.equal(q.dequantize(torch.float32), nvfp4.fake_quantize(w.float(), amax=amax)), p + proj
            assert torch.equal(out.get(p + "gate_proj.weight_scale_2"), out.get(p + "up_proj.weight_scale_2"))
        kept = [n for n in src.keys() if ".experts." not in n]
        assert kept and all(torch.equal(src.get(n), out.get(n)) for n in kept)   # carve-outs stay BF16, bitwise


def test_modelopt_dequantizes_the_checkpoint_to_the_same_values(quads_ckpt):
    qtensor = pytest.importorskip("modelopt.torch.quantization.qtensor.nvfp4_tensor",
                                  reason="nvidia-modelopt (installed --no-deps) is not importable")
    with HFCheckpoint(quads_ckpt) as out:
        dims = qwen3_moe.dims_from_hf_config(out.config)
        for _, _, p in _expert_bases(dims):
            for proj in ("gate_proj", "down_proj"):
                q = _nvfp4(out, p + proj)
                mo = qtensor.NVFP4QTensor(q.shape, torch.float32, out.get(p + proj + ".weight"))
                theirs = mo.dequantize(dtype=torch.float32, scale=out.get(p + proj + ".weight_scale"),
                                       double_scale=out.get(p + proj + ".weight_scale_2"), block_sizes={-1: 16})
                # ModelOpt rounds e2m1 * (sf * S_dec), we (e2m1 * sf) * S_dec (exact first product): 1 fp32 ulp.
                torch.testing.assert_close(theirs, q.dequantize(torch.float32), rtol=2.5e-7, atol=0)


def test_quads_config(quads_ckpt):
    from quads_megatron.plan.rollout_schema import parse_quantization_config

    cfg = json.loads((quads_ckpt / "config.json").read_text())
    qc = cfg["quantization_config"]
    settings = parse_quantization_config(qc)
    assert (settings.precision, settings.activation_scaling, settings.rac_channels) == ("w4a4_rac", "per_token", K)
    assert qc["quant_method"] == "quads" and "model.layers.*.mlp.gate" in qc["exclude_modules"]
    summary = json.loads((quads_ckpt / "hf_quant_config.json").read_text())
    assert summary["quantization"]["quant_algo"] == "NVFP4" and summary["quads"] == qc


def _check_activation_tensors(ckpt, reference, static):
    with HFCheckpoint(ckpt) as out:
        dims = qwen3_moe.dims_from_hf_config(out.config)
        for layer in range(dims.num_layers):
            fc1_amax, fc2_amax, fc1_score, fc2_score = _expected_layer(reference[layer], static=static)
            assert float(fc1_amax) > 0 and float(fc2_amax) > 0
            p = f"model.layers.{layer}.mlp.experts."
            fc1_idx = out.get(f"{p}0.gate_proj.input_comp_index")
            _assert_top_k(fc1_idx, fc1_score, K, f"layer {layer} fc1")
            for e in range(dims.num_experts):
                for proj in ("gate_proj", "up_proj"):
                    # input_scale is the decode scale S_dec = amax / 2688 of fc1's input, every token
                    torch.testing.assert_close(out.get(f"{p}{e}.{proj}.input_scale"), fc1_amax / 2688,
                                               rtol=1e-6, atol=0)
                    assert torch.equal(out.get(f"{p}{e}.{proj}.input_comp_index"), fc1_idx)
                torch.testing.assert_close(out.get(f"{p}{e}.down_proj.input_scale"), fc2_amax / 2688,
                                           rtol=1e-5, atol=0)
                _assert_top_k(out.get(f"{p}{e}.down_proj.input_comp_index"), fc2_score[e], K,
                              f"layer {layer} expert {e} fc2")
        # by design (convert_fixtures): embedding channel 5 is a x20 outlier; in layer 0 it sets its
        # 16-block's scale, so the other channels of block 0..15 carry the largest fc1 error
        fc1_l0 = out.get("model.layers.0.mlp.experts.0.gate_proj.input_comp_index")
        assert len(set(fc1_l0.tolist()) & set(range(16))) >= 12


def test_calibrated_activation_tensors_match_the_reference(quads_ckpt, reference):
    _check_activation_tensors(quads_ckpt, reference, static=False)


def test_modelopt_format_is_plain_modelopt_nvfp4(quads_ckpt, modelopt_ckpt):
    from quads_megatron.plan.rollout_schema import is_modelopt_nvfp4

    cfg = json.loads((modelopt_ckpt / "config.json").read_text())
    qc = cfg["quantization_config"]
    summary = json.loads((modelopt_ckpt / "hf_quant_config.json").read_text())
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "NVFP4" and is_modelopt_nvfp4(qc)
    assert qc["config_groups"]["group_0"]["weights"] == {"dynamic": False, "num_bits": 4, "type": "float",
                                                         "group_size": 16}
    assert summary["quantization"] == {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                       "exclude_modules": qc["ignore"]}
    with HFCheckpoint(modelopt_ckpt) as mo, HFCheckpoint(quads_ckpt) as qd:
        assert not [n for n in mo.keys() if n.endswith("input_comp_index")]
        name = "model.layers.1.mlp.experts.3.down_proj"
        for suffix in ("weight", "weight_scale", "weight_scale_2"):   # same NVFP4 weights as the quads export
            a, b = mo.get(f"{name}.{suffix}"), qd.get(f"{name}.{suffix}")
            assert a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        assert mo.get(f"{name}.input_scale").dtype == torch.float32


def test_recipe_carve_out_keeps_a_layer_bf16(tiny_hf, tmp_path):
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps({"bf16_first_layers": 1}))
    out = tmp_path / "w4a16"
    rollout_export.main(["--load-dir", str(tiny_hf), "--save-dir", str(out), "--quads-recipe", str(recipe),
                         "--rollout-precision", "w4a16", "--no-progress"])
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.mlp.experts*" in qc["exclude_modules"] and qc["precision"] == "w4a16"
    with HFCheckpoint(tiny_hf) as src, HFCheckpoint(out) as ck:
        name = "model.layers.0.mlp.experts.1.up_proj.weight"
        assert torch.equal(ck.get(name), src.get(name))
        assert ck.dtype("model.layers.1.mlp.experts.1.up_proj.weight") == torch.uint8
        assert not [n for n in ck.keys() if n.endswith(("input_scale", "input_comp_index"))]


def test_static_activation_scaling_calibrates_with_the_static_scale(tiny_hf, calib_flags, reference, tmp_path):
    out = tmp_path / "static"
    rollout_export.main(["--load-dir", str(tiny_hf), "--save-dir", str(out), "--rac-channels", str(K),
                         "--activation-scaling", "static", *calib_flags])
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["activation_scaling"] == "static"
    # same amax; RAC channels ranked by the error under the static per-tensor scale
    _check_activation_tensors(out, reference, static=True)


def test_calibration_prompts_from_jsonl(tiny_hf, tmp_path):
    from quads_megatron.convert.calibration import load_prompts
    from quads_megatron.errors import InputError

    tok = _char_tokenizer(tmp_path / "tok")
    data = tmp_path / "calib.jsonl"
    data.write_text('{"text": "What is 12 + 30?"}\n\n{"prompt": "Sort the list 3 1 2."}\n')
    prompts = load_prompts(data, tok, num_samples=8, seq_len=10)
    assert [p.tolist() for p in prompts] == [[ord(c) - 32 for c in "What is 12"], [ord(c) - 32 for c in "Sort the l"]]
    out = tmp_path / "out"
    rollout_export.main(["--load-dir", str(tiny_hf), "--save-dir", str(out), "--rac-channels", str(K),
                         "--calib-data", str(data), "--tokenizer-dir", str(tok), "--calib-seq-len", "10",
                         "--no-progress"])
    calib = json.loads((out / "config.json").read_text())["quantization_config"]["calibration"]
    assert calib == {"source": str(data), "num_samples": 2, "num_tokens": 20}
    data.write_text('{"text": "ok"}\n{"content": 3}\n')
    with pytest.raises(InputError, match=r"calib.jsonl:2: expected a 'text' or 'prompt' string field"):
        load_prompts(data, tok, num_samples=8, seq_len=10)
