"""HF -> QUADS / ModelOpt NVFP4 rollout checkpoints: exact trainer view, ModelOpt decoding, configs, calibration."""

import json

import pytest
import torch

from quads_megatron import nvfp4
from quads_megatron.convert import qwen3_moe, rollout_export
from quads_megatron.convert.calibration import calibrate, random_prompts
from quads_megatron.convert.hf_checkpoint import HFCheckpoint
from quads_megatron.nvfp4 import NVFP4Tensor

CALIB = ["--calib-size", "3", "--calib-seq-len", "16", "--no-progress"]
K = 16


@pytest.fixture(scope="module")
def quads_ckpt(tiny_hf, tmp_path_factory):
    out = tmp_path_factory.mktemp("rollout") / "quads"
    rollout_export.main(["--load-dir", str(tiny_hf), "--save-dir", str(out), "--rac-channels", str(K), *CALIB])
    return out


@pytest.fixture(scope="module")
def modelopt_ckpt(tiny_hf, tmp_path_factory):
    out = tmp_path_factory.mktemp("rollout") / "modelopt"
    rollout_export.main(["--load-dir", str(tiny_hf), "--save-dir", str(out), "--format", "modelopt", *CALIB])
    return out


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


def test_quads_config_and_calibrated_activation_tensors(tiny_hf, quads_ckpt):
    from quads_megatron.plan.rollout_schema import parse_quantization_config
    from transformers import Qwen3MoeForCausalLM

    cfg = json.loads((quads_ckpt / "config.json").read_text())
    qc = cfg["quantization_config"]
    settings = parse_quantization_config(qc, env={})
    assert (settings.precision, settings.activation_scaling, settings.rac_channels) == ("w4a4_rac", "per_token", K)
    assert qc["quant_method"] == "quads" and "model.layers.*.mlp.gate" in qc["exclude_modules"]
    summary = json.loads((quads_ckpt / "hf_quant_config.json").read_text())
    assert summary["quantization"]["quant_algo"] == "NVFP4" and summary["quads"] == qc

    # The stored input_scale / input_comp_index are the calibration of the same prompts, placed per
    # expert, the channels ranked with the checkpoint's own NVFP4 weights.
    model = Qwen3MoeForCausalLM.from_pretrained(str(tiny_hf), dtype=torch.bfloat16)
    with HFCheckpoint(quads_ckpt) as out:
        dims = qwen3_moe.dims_from_hf_config(out.config)
        calib = calibrate(model, random_prompts(dims.vocab_size, num_samples=3, seq_len=16, seed=0),
                          rac_stats=True, progress=False)
        indices = {}
        for layer in range(dims.num_layers):
            p = f"model.layers.{layer}.mlp.experts."
            w13 = torch.stack([torch.cat([_nvfp4(out, f"{p}{e}.{n}").dequantize(torch.float32)
                                          for n in ("gate_proj", "up_proj")]) for e in range(dims.num_experts)])
            w2 = torch.stack([_nvfp4(out, f"{p}{e}.down_proj").dequantize(torch.float32)
                              for e in range(dims.num_experts)])
            indices[layer] = calib[layer].comp_indices(w13, w2, K)
        for layer, e, p in _expert_bases(dims):
            c, (fc1_idx, fc2_idx) = calib[layer], indices[layer]
            for proj in ("gate_proj", "up_proj"):
                assert torch.equal(out.get(p + proj + ".input_scale"), nvfp4.global_decode_scale(c.fc1_amax))
                assert torch.equal(out.get(p + proj + ".input_comp_index"), fc1_idx)
            assert torch.equal(out.get(p + "down_proj.input_scale"), nvfp4.global_decode_scale(c.fc2_amax[e]))
            idx = out.get(p + "down_proj.input_comp_index")
            assert idx.dtype == torch.int32 and idx.shape == (K,) and torch.equal(idx, fc2_idx[e])
            assert bool((idx[1:] > idx[:-1]).all()) and int(idx.max()) < dims.moe_ffn
        assert c.fc1_amax > 0 and bool((c.fc2_amax > 0).all())
        # Embedding channel 5 is a x20 outlier: it sets its 16-block's scale, so the other channels of
        # block 0..15 carry layer 0's largest fc1 activation error and fill most of its RAC set.
        assert len(set(indices[0][0].tolist()) & set(range(16))) >= 12


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
    rollout_export.main(["--load-dir", str(tiny_hf), "--save-dir", str(out), "--recipe", str(recipe),
                         "--rollout-precision", "w4a16", "--no-progress"])
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.mlp.experts*" in qc["exclude_modules"] and qc["precision"] == "w4a16"
    with HFCheckpoint(tiny_hf) as src, HFCheckpoint(out) as ck:
        name = "model.layers.0.mlp.experts.1.up_proj.weight"
        assert torch.equal(ck.get(name), src.get(name))
        assert ck.dtype("model.layers.1.mlp.experts.1.up_proj.weight") == torch.uint8
        assert not [n for n in ck.keys() if n.endswith(("input_scale", "input_comp_index"))]


def test_static_activation_scaling_calibrates_with_the_static_scale(tiny_hf, quads_ckpt, tmp_path):
    out = tmp_path / "static"
    rollout_export.main(["--load-dir", str(tiny_hf), "--save-dir", str(out), "--rac-channels", str(K),
                         "--activation-scaling", "static", *CALIB])
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["activation_scaling"] == "static"
    with HFCheckpoint(out) as st, HFCheckpoint(quads_ckpt) as pt:
        name = "model.layers.0.mlp.experts.0.gate_proj."
        assert torch.equal(st.get(name + "input_scale"), pt.get(name + "input_scale"))   # same calibration amax
        idx = st.get(name + "input_comp_index")
        assert idx.shape == (K,) and idx.dtype == torch.int32


def _char_tokenizer(path):
    """A character-level fast tokenizer (ids < 96 fit the tiny vocabulary), built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(i): i - 32 for i in range(32, 127)} | {"[UNK]": 95}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)
    return path


def test_calibration_prompts_from_jsonl(tiny_hf, tmp_path):
    from quads_megatron.convert.calibration import load_prompts
    from quads_megatron.convert.errors import CheckpointError

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
    with pytest.raises(CheckpointError, match=r"calib.jsonl:2: expected a 'text' or 'prompt' string field"):
        load_prompts(data, tok, num_samples=8, seq_len=10)
