"""GPU: the rollout export quantizes with the Triton NVFP4 kernels on CUDA, bit-identical to the CPU export."""

import pytest
import torch

from convert_fixtures import assert_same_checkpoint
from quads_megatron.convert import rollout_export
from quads_megatron.convert.hf_checkpoint import HFCheckpoint


@pytest.mark.gpu
def test_cuda_export_is_bitwise_the_cpu_export(tiny_hf, tmp_path):
    base = ["--load-dir", str(tiny_hf), "--rollout-precision", "w4a16", "--no-progress"]
    rollout_export.main(base + ["--save-dir", str(tmp_path / "cpu")])
    rollout_export.main(base + ["--save-dir", str(tmp_path / "cuda"), "--device", "cuda"])
    assert_same_checkpoint(tmp_path / "cpu", tmp_path / "cuda")


@pytest.mark.gpu
def test_cuda_calibrated_rac_export(tiny_hf, tmp_path):
    rollout_export.main(["--load-dir", str(tiny_hf), "--save-dir", str(tmp_path / "rac"), "--device", "cuda",
                         "--rac-channels", "16", "--calib-size", "4", "--calib-seq-len", "32", "--no-progress"])
    with HFCheckpoint(tmp_path / "rac") as ck:
        idx = ck.get("model.layers.1.mlp.experts.3.down_proj.input_comp_index")
        assert idx.dtype == torch.int32 and idx.shape == (16,) and bool((idx[1:] > idx[:-1]).all())
        assert float(ck.get("model.layers.1.mlp.experts.3.down_proj.input_scale")) > 0
