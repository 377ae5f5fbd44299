"""The benchmarks' one timer (``quads_megatron.apps.study.timing.time_ms``) on a CPU: it calls ``fn`` exactly
warm-up + iters times and reports the median per call, so a call that sleeps a known time reads as that time
whichever mode a tool asks for (the CUDA modes fall back to perf_counter off a GPU)."""

import time

import pytest

from quads_megatron.apps.study.timing import MODES, copy_bandwidth, time_ms


@pytest.mark.parametrize("mode", MODES)
def test_cpu_time_is_the_median_of_the_timed_calls(mode):
    calls = []
    delays = iter([0.050] * 2 + [0.004, 0.004, 0.004, 0.030, 0.004])   # 2 warm-ups, then one slow outlier

    def fn():
        calls.append(1)
        time.sleep(next(delays))

    ms = time_ms(fn, device="cpu", iters=5, warmup=2, mode=mode)
    assert len(calls) == 7
    assert 4.0 <= ms < 25.0, ms     # the median ignores the warm-ups and the 30 ms outlier


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="mode 'fast'"):
        time_ms(lambda: None, device="cpu", mode="fast")
    with pytest.raises(ValueError, match="iters 0"):
        time_ms(lambda: None, device="cpu", iters=0)


def test_copy_bandwidth_is_nan_off_a_gpu():
    bw = copy_bandwidth("cpu")
    assert bw != bw
