"""SGLang HTTP engine against a minimal server speaking SGLang's wire format (SGLang cannot serve on CPU).

Checks what the engine sends (generate payload, begin/update/end weight-update order, the synced
safetensors) and how it reads responses and errors; the real server is exercised on GPU.
"""

import contextlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from quads_megatron.rl.engines.base import SamplingParams
from quads_megatron.rl.engines.sglang_http import SGLangEngine, SGLangError


class _Server:
    def __init__(self, fail_update=False, tp_size=1, routes=None, quantization=None, num_experts=64):
        """routes: (layers, top_k) to answer meta_info.routed_experts as SGLang's detokenizer encodes it (ids
        drawn from ``num_experts``); quantization: the server's --quantization, as /get_server_info reports it."""
        self.calls, self.fail_update, self.tp_size, self.received = [], fail_update, tp_size, []
        self.quantization, self.num_experts = quantization, num_experts
        self.routes, self.sent_routes = routes, []
        owner = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _reply(self, obj, code=200):
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                owner.calls.append((self.path, None))
                info = {"tp_size": owner.tp_size, "quantization": owner.quantization}
                self._reply(info if self.path == "/get_server_info" else {})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                owner.calls.append((self.path, body))
                if self.path == "/generate":
                    n = body["sampling_params"]["max_new_tokens"]
                    outs = [{"output_ids": [7] * (n - 1) + [1],
                             "meta_info": {"output_token_logprobs": [[-0.5, 7, None]] * (n - 1) + [[-0.1, 1, None]],
                                           "finish_reason": {"type": "stop"}}} for _ in body["input_ids"]]
                    if owner.routes and body.get("return_routed_experts"):
                        import pybase64

                        for o, ids in zip(outs, body["input_ids"]):
                            t = torch.stack([torch.randperm(owner.num_experts)[:owner.routes[1]].int()
                                             for _ in range((len(ids) + n - 1) * owner.routes[0])])
                            t = t.view(len(ids) + n - 1, *owner.routes)  # distinct experts per top-k set
                            owner.sent_routes.append(t)  # SGLang's detokenizer: b64 of the int32 bytes
                            o["meta_info"]["routed_experts"] = pybase64.b64encode(t.numpy().tobytes()).decode("utf-8")
                    return self._reply(outs)
                if self.path == "/update_weights_from_tensor":
                    from sglang.srt.utils import MultiprocessingSerializer

                    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

                    # what SGLang's weight updater does with load_format="flattened_bucket"
                    assert body["load_format"] == "flattened_bucket"
                    payloads = [MultiprocessingSerializer.deserialize(b) for b in body["serialized_named_tensors"]]
                    owner.received.append([FlattenedTensorBucket(flattened_tensor=p["flattened_tensor"],
                                                                 metadata=p["metadata"]).reconstruct_tensors()
                                           for p in payloads])
                if self.path == "/update_weights_from_disk" and owner.fail_update:
                    return self._reply({"success": False, "message": "shape mismatch in w13_weight"}, 400)
                self._reply({"success": True, "message": ""})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def paths(self):
        return [p for p, _ in self.calls]


@contextlib.contextmanager
def trainer_against(server: _Server, argv: list):
    """The GRPO trainer of ``argv`` (rollouts from ``server``); afterwards the trainer closed, the server shut
    down and the process group destroyed, whatever happened."""
    from quads_megatron.rl.arguments import parse_args
    from quads_megatron.rl.loop import GRPOTrainer

    try:
        trainer = GRPOTrainer(parse_args(argv))
        try:
            yield trainer
        finally:
            trainer.close()
    finally:
        server.httpd.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture
def servers():
    made = []

    def make(**kw):
        made.append(_Server(**kw))
        return made[-1]
    yield make
    for s in made:
        s.httpd.shutdown()


def test_generate_spreads_prompts_and_reads_logprobs(servers):
    a, b = servers(), servers()
    eng = SGLangEngine([a.url, b.url], max_seq_len=32)
    outs = eng.generate([[2, 5, 6]] * 3, SamplingParams(temperature=0.7, max_new_tokens=4, stop_token_ids=[1]), seed=3)
    assert [o.response_ids for o in outs] == [[7, 7, 7, 1]] * 3
    assert outs[0].logprobs == [-0.5, -0.5, -0.5, -0.1] and all(o.finished for o in outs)
    ga = [body for p, body in a.calls if p == "/generate"][0]
    gb = [body for p, body in b.calls if p == "/generate"][0]
    assert len(ga["input_ids"]) + len(gb["input_ids"]) == 3 and ga["return_logprob"] is True
    assert ga["sampling_params"]["temperature"] == 0.7 and ga["sampling_params"]["stop_token_ids"] == [1]
    with pytest.raises(ValueError, match="exceeds --seq-length 32"):
        eng.generate([[2] * 30], SamplingParams(max_new_tokens=4), seed=0)


def test_weight_update_from_disk_is_bracketed(servers, tmp_path):
    s = servers()
    eng = SGLangEngine([s.url], max_seq_len=32, weight_sync="disk", sync_dir=str(tmp_path))
    w = {"model.embed_tokens.weight": torch.randn(8, 4), "model.layers.0.mlp.experts.0.gate_proj.weight_scale_2": torch.tensor(0.5)}
    eng.update_weights(w.items())
    upd = [p for p in s.paths() if "weight" in p]
    assert upd == ["/begin_weight_update", "/update_weights_from_disk", "/end_weight_update"]
    path = [b for p, b in s.calls if p == "/update_weights_from_disk"][0]["model_path"]
    got = load_file(f"{path}/model.safetensors")
    assert set(got) == set(w) and torch.equal(got["model.embed_tokens.weight"], w["model.embed_tokens.weight"])


def test_disk_sync_replaces_its_own_copy_across_runs_and_refuses_a_user_directory(servers, tmp_path):
    """The disk sync goes through the one output writer: a later run replaces the previous run's copy (its
    marker says it is ours), a user's own ``weights`` directory in --sglang-sync-dir is refused and kept."""
    from quads_megatron.errors import CheckpointError

    s = servers()
    for value in (1.0, 2.0):     # two runs (two engines) over one --sglang-sync-dir
        eng = SGLangEngine([s.url], max_seq_len=32, weight_sync="disk", sync_dir=str(tmp_path))
        eng.update_weights([("x.weight", torch.full((2,), value))])
        assert torch.equal(load_file(str(tmp_path / "weights" / "model.safetensors"))["x.weight"], torch.full((2,), value))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights"]   # no temporaries, no lock file left
    user = tmp_path / "user"
    (user / "weights").mkdir(parents=True)
    (user / "weights" / "notes.txt").write_text("mine")
    eng = SGLangEngine([s.url], max_seq_len=32, weight_sync="disk", sync_dir=str(user))
    with pytest.raises(CheckpointError, match="'notes.txt'"):
        eng.update_weights([("x.weight", torch.zeros(2))])
    assert (user / "weights" / "notes.txt").read_text() == "mine" and s.paths()[-1] == "/end_weight_update"


def test_weight_update_from_tensor_one_payload_per_tp_rank(servers):
    s = servers(tp_size=2)
    eng = SGLangEngine([s.url], max_seq_len=32, weight_sync="tensor")
    w = [("model.layers.0.mlp.experts.1.down_proj.weight", torch.randint(0, 255, (8, 4), dtype=torch.uint8)),
         ("model.layers.0.mlp.experts.1.down_proj.weight_scale", torch.rand(8, 1).to(torch.float8_e4m3fn))]
    eng.update_weights(w)
    assert [p for p in s.paths() if "weight" in p] == ["/begin_weight_update", "/update_weights_from_tensor",
                                                        "/end_weight_update"]
    ((rank0, rank1),) = s.received  # one bucket, one payload per TP rank
    for payload in (rank0, rank1):
        got = dict(payload)
        assert sorted(got) == sorted(n for n, _ in w)
        assert all(got[n].dtype == ref.dtype and torch.equal(got[n].float(), ref.float()) for n, ref in w)


def test_tensor_sync_buckets_keep_every_tensor_bitwise_and_aligned(servers):
    """Flat buckets of at most bucket_bytes; an fp32 scale after odd-sized uint8 codes still views in place
    on the server (SGLang's FlattenedTensorBucket.reconstruct_tensors), bit for bit; one flush at the end."""
    s = servers(tp_size=1)
    eng = SGLangEngine([s.url], max_seq_len=32, weight_sync="tensor", bucket_bytes=64)
    g = torch.Generator().manual_seed(0)
    w = []
    for e in range(3):
        pre = f"model.layers.0.mlp.experts.{e}.down_proj"
        w += [(f"{pre}.weight", torch.randint(0, 255, (5, 7), dtype=torch.uint8, generator=g)),  # 35 bytes
              (f"{pre}.weight_scale", torch.rand(5, 2, generator=g).to(torch.float8_e4m3fn)),  # fp32 next at 45
              (f"{pre}.weight_scale_2", torch.rand((), generator=g)),
              (f"{pre}.input_scale", torch.rand((), generator=g).to(torch.bfloat16))]
    w.append(("model.embed_tokens.weight", torch.randn(8, 4, generator=g)))  # 128 bytes: alone in its bucket
    eng.update_weights(w)
    calls = [b for p, b in s.calls if p == "/update_weights_from_tensor"]
    assert len(calls) == len(s.received) > 1
    assert [b["flush_cache"] for b in calls] == [False] * (len(calls) - 1) + [True]
    got = {n: t for bucket in s.received for (payload,) in [bucket] for n, t in payload}
    assert sorted(got) == sorted(n for n, _ in w)
    for name, ref in w:
        t = got[name]
        assert t.dtype == ref.dtype and t.shape == ref.shape, name
        assert torch.equal(t.reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8)), name


def test_sync_stream_of_mixed_devices_goes_out_on_one():
    """The GRPO job's calibrated sync: weights on the accelerator, then the calibration's host-side input scales
    and RAC channels; one flat bucket is one tensor, so everything joins the weights' device, values intact
    (found on the H100: FlattenedTensorBucket's cat refused a bucket of CUDA and CPU tensors)."""
    from quads_megatron.rl.engines.sglang_http import on_one_device

    weights = torch.randint(0, 255, (4, 8), dtype=torch.uint8).to("meta")  # stands for the GPU
    scale, comp = torch.tensor(0.25), torch.tensor([1, 5, 9], dtype=torch.int32)
    out = on_one_device([("w.weight", weights), ("w.input_scale", scale), ("w.input_comp_index", comp)])
    assert [t.device.type for _, t in out] == ["meta"] * 3
    assert [(n, t.dtype, tuple(t.shape)) for n, t in out] == [
        ("w.weight", torch.uint8, (4, 8)), ("w.input_scale", torch.float32, ()), ("w.input_comp_index", torch.int32, (3,))]
    host = on_one_device([("a", scale), ("b", comp)])  # all on the host: unchanged
    assert host[0][1] is scale and host[1][1] is comp


def test_failed_update_raises_and_still_closes_session(servers, tmp_path):
    s = servers(fail_update=True)
    eng = SGLangEngine([s.url], max_seq_len=32, weight_sync="disk", sync_dir=str(tmp_path))
    with pytest.raises(SGLangError, match="shape mismatch in w13_weight"):
        eng.update_weights([("x.weight", torch.zeros(2))])
    assert s.paths()[-1] == "/end_weight_update"


def test_router_generates_through_router(servers):
    worker, router = servers(), servers()
    eng = SGLangEngine([worker.url], max_seq_len=32, router_url=router.url)
    eng.generate([[2, 3]] * 2, SamplingParams(max_new_tokens=2, stop_token_ids=[1]), seed=0)
    assert "/generate" in router.paths() and "/generate" not in worker.paths()


def test_bf16_weight_sync_sends_high_precision_tensors(servers):
    """--sglang-weight-sync tensor-bf16: the trainer skips its NVFP4 step; the same endpoint gets BF16."""
    s = servers(tp_size=1)
    eng = SGLangEngine([s.url], max_seq_len=32, weight_sync="tensor-bf16")
    assert not eng.sends_nvfp4 and SGLangEngine([s.url], max_seq_len=32).sends_nvfp4
    w = [("model.layers.0.mlp.experts.1.down_proj.weight", torch.randn(8, 32).to(torch.bfloat16))]
    eng.update_weights(w)
    assert [p for p in s.paths() if "weight" in p] == ["/begin_weight_update", "/update_weights_from_tensor",
                                                        "/end_weight_update"]
    (((name, t),),) = s.received[0]
    assert name == w[0][0] and t.dtype == torch.bfloat16 and torch.equal(t, w[0][1])


@pytest.mark.parametrize("tp_size,quantization,mode,stacked", [
    (1, "quads", "tensor", True), (1, "quads", "tensor-bf16", True), (2, "quads", "tensor", False),
    (1, None, "tensor", False), (1, "quads", "disk", False)])
def test_layers_go_out_whole_only_to_unsharded_quads_servers(servers, tmp_path, tp_size, quantization, mode, stacked):
    """A layer item is sent as FusedMoE parameters (one server load call each) only by a tensor sync to quads
    servers of tp_size 1; otherwise under the per-expert names the server's own TP/EP slicing takes."""
    from quads_megatron.plan import ExpertsLayer, QuantPlan, quantize_named_params
    from quads_megatron.models import qwen3_moe
    from quads_megatron.recipe import QuadsRecipe

    E, H, F = 2, 32, 16
    dims = qwen3_moe.Dims(vocab_size=96, hidden_size=H, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
                          num_experts=E, moe_ffn=F, tie_word_embeddings=False)
    plan = QuantPlan.resolve(QuadsRecipe(rollout_precision="w4a4"), dims)
    layer = ExpertsLayer(0, torch.randn(E, 2 * F, H).to(torch.bfloat16), torch.randn(E, H, F).to(torch.bfloat16))
    s = servers(tp_size=tp_size, quantization=quantization)
    eng = SGLangEngine([s.url], max_seq_len=32, weight_sync=mode, sync_dir=str(tmp_path), stacked_experts=True)
    assert eng.sends_stacked == stacked
    assert SGLangEngine([s.url], max_seq_len=32, weight_sync=mode, sync_dir=str(tmp_path)).sends_stacked == stacked
    assert not SGLangEngine([s.url], max_seq_len=32, weight_sync=mode, sync_dir=str(tmp_path),
                            stacked_experts=False).sends_stacked
    stream = [layer] if mode == "tensor-bf16" else list(quantize_named_params([layer], plan, keep_layers=True))
    eng.update_weights(stream)
    if mode == "disk":
        path = [b for p, b in s.calls if p == "/update_weights_from_disk"][0]["model_path"]
        names = set(load_file(f"{path}/model.safetensors"))
    else:
        names = {n for bucket in s.received for n, _ in bucket[0]}
    pre = "model.layers.0.mlp.experts"
    if stacked:
        want = {"w13_weight", "w2_weight"} if mode == "tensor-bf16" else {
            f"{w}_{k}" for w in ("w13", "w2") for k in ("weight", "weight_scale", "weight_scale_2")}
        assert names == {f"{pre}.{n}" for n in want}
    else:
        assert len(names) == 9 * E and f"{pre}.1.up_proj.weight_scale_2" in names


def test_bf16_weight_sync_refuses_an_attention_scope():
    from quads_megatron.errors import ConfigError
    from quads_megatron.rl.arguments import parse_args

    with pytest.raises(ConfigError, match="tensor-bf16: the server quantizes routed experts only"):
        parse_args(["--rollout-engine", "sglang", "--sglang-url", "http://127.0.0.1:9", "--sglang-weight-sync",
                    "tensor-bf16", "--quads-scope", "routed_experts", "attention"])


def test_routed_experts_are_requested_and_decoded_per_sample(servers):
    """SGLang's routed-experts capture: requested on /generate, decoded to [prompt + response - 1, L, K] as
    SGLang's own decoder (extract_routed_experts_from_meta_info) reads the same payload."""
    from transformers import Qwen3MoeConfig

    from sglang.srt.state_capturer.routed_experts import extract_routed_experts_from_meta_info

    cfg = Qwen3MoeConfig(num_hidden_layers=3, num_experts_per_tok=2, num_experts=64)
    s = servers(routes=(3, 2))
    eng = SGLangEngine([s.url], max_seq_len=32, hf_config=cfg)
    prompts = [[2, 5, 6], [9, 4, 4, 4, 3]]
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=4, stop_token_ids=[1]), seed=3)
    body = [b for p, b in s.calls if p == "/generate"][0]
    assert body["return_routed_experts"] is True
    for o, p, sent in zip(outs, prompts, s.sent_routes):
        assert o.routed_experts.shape == (len(p) + 4 - 1, 3, 2) and torch.equal(o.routed_experts, sent)
    import pybase64

    meta = {"meta_info": {"routed_experts": pybase64.b64encode(s.sent_routes[0].numpy().tobytes()).decode()}}
    assert extract_routed_experts_from_meta_info(meta).tolist() == outs[0].routed_experts.flatten().tolist()


def test_a_server_without_the_capture_gives_no_routes_and_a_wrong_size_is_an_error(servers):
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(num_hidden_layers=3, num_experts_per_tok=2, num_experts=64)
    plain = servers()
    (o,) = SGLangEngine([plain.url], max_seq_len=32, hf_config=cfg).generate([[2, 5]], SamplingParams(max_new_tokens=2),
                                                                             seed=0)
    assert o.routed_experts is None
    wrong = servers(routes=(2, 2))  # the server's model has 2 layers, the trainer's 3
    with pytest.raises(SGLangError, match="routed_experts holds .* expected"):
        SGLangEngine([wrong.url], max_seq_len=32, hf_config=cfg).generate([[2, 5]], SamplingParams(max_new_tokens=2),
                                                                          seed=0)
