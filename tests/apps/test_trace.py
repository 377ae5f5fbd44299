"""The trace reader on a real torch profiler trace: the calls counted per op are the calls the test made."""

import gzip
import shutil

import pytest
import torch

from quads_megatron.apps.study.trace import kernel_times, per_step_table


def _profile(path):
    a = torch.randn(64, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            torch.mm(a, a)
        for _ in range(2):
            torch.relu(a)
    prof.export_chrome_trace(str(path))


def test_ops_are_counted_and_timed(tmp_path):
    trace = tmp_path / "t.json"
    _profile(trace)
    gz = tmp_path / "t.json.gz"
    with open(trace, "rb") as src, gzip.open(gz, "wb") as dst:
        shutil.copyfileobj(src, dst)
    for path in (trace, gz):
        times = {k.name: k for k in kernel_times(path, category="cpu_op")}
        assert times["aten::mm"].calls == 3 and times["aten::relu"].calls == 2
        assert times["aten::mm"].total_us > 0
    with pytest.raises(ValueError, match="no 'kernel' events"):
        kernel_times(trace)


def test_per_step_table_divides_by_steps(tmp_path):
    trace = tmp_path / "t.json"
    trace.write_text('{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "gemm", "dur": 30},'
                     '{"ph": "X", "cat": "kernel", "name": "gemm", "dur": 30}, {"ph": "X", "cat": "kernel",'
                     ' "name": "quant", "dur": 6}, {"ph": "i", "cat": "kernel", "name": "mark"}]}')
    table = per_step_table({"srv": kernel_times(trace)}, steps=2)
    assert "srv: 33.0 us of kernels per step, 2 launches" in table
    assert "gemm" in table.splitlines()[1] and "30.0 us" in table.splitlines()[1]
