"""What one GPU can check (marker ``gpu``, skipped without CUDA): ``python -m pytest -m gpu``.

The checks are benchmarks/gpu_smoke.py's, one test each, so the script and the tests cannot drift
apart: the in-process S=4 pipeline in bf16-mixed against one device, peak memory against the
estimate, activation checkpointing with dropout, a checkpoint round trip, the monitor's CUDA-event
timings and the host syncs per optimizer step. Beside them, the CUDA clock on real events. NCCL
between processes needs two GPUs; the strict-order transport tests carry that part on CPU.

One test here runs without a GPU: the script's command line on CPU, so it keeps working until the
first GPU runs it.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (flush_exact), before CUDA starts

import json  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from benchmarks import gpu_smoke  # noqa: E402
from lit_efficient.runtime.clock import CudaClock, Spans  # noqa: E402

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda_only
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", list(gpu_smoke.CHECKS))
def test_smoke_check_passes_on_cuda(name):
    result = gpu_smoke.CHECKS[name]("cuda")
    assert result.status == "pass", f"{result.detail}\n{json.dumps(result.numbers, default=str)[:4000]}"


@pytest.mark.gpu
@cuda_only
def test_cuda_clock_times_the_device_work_not_its_launch():
    """An event span covers the kernel's run on the GPU; host time around the launch is far shorter, and
    recording the events waits for nothing (sync debug mode set to raise)."""
    clock = CudaClock("cuda")
    # Warm up: the first launch loads the kernel (16 ms of host time on the first H200 run, over the bound below).
    clock.mark()
    torch.cuda._sleep(1)
    clock.mark()
    torch.cuda.synchronize()
    spans = Spans(clock)
    torch.cuda.set_sync_debug_mode("error")
    try:
        host_start = time.perf_counter()
        start = clock.mark()
        torch.cuda._sleep(50_000_000)  # ~25-50 ms of GPU time at 1-2 GHz
        spans.add("forward", start, clock.mark())
        launch = time.perf_counter() - host_start
        assert spans.pending == 1  # the kernel is still running: nothing resolved yet
    finally:
        torch.cuda.set_sync_debug_mode(0)
    device = spans.total("forward")
    assert device >= 0.005 and device > 5 * launch, (device, launch)
    placed = clock.host_seconds([start])
    assert host_start - 0.01 <= placed[0] <= time.perf_counter()


def test_smoke_script_runs_on_cpu_and_writes_its_table_and_json(tmp_path, capsys):
    """The command line the first GPU runs, here on CPU with every check but the compiling one (seconds; the
    compiled prediction's own test is tests/runtime/test_staleness.py): a check that broke against the package
    (the memory check read the split after fit, gone since the model returns whole) fails here, not on the GPU."""
    out = tmp_path / "smoke.json"
    names = [name for name in gpu_smoke.CHECKS if name != "weight_prediction"]
    assert gpu_smoke.main(["--device", "cpu", "--checks", *names, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "host_syncs" in printed and "PASS" in printed and "0 failed" in printed
    saved = {c["name"]: c for c in json.loads(out.read_text())["checks"]}
    assert list(saved) == names
    assert saved["memory"]["status"] == "skip"  # no allocator peak on CPU; the estimate still computed
    assert saved["memory"]["numbers"]["estimate_bytes"] > saved["memory"]["numbers"]["weights_grads_adam_bytes"]
    assert all(saved[n]["status"] == "pass" for n in names if n != "memory"), saved
    assert saved["host_syncs"]["numbers"]["syncs"] == saved["host_syncs"]["numbers"]["optimizer_steps"]


@pytest.mark.gpu
@cuda_only
@pytest.mark.timeout(240)
def test_layer_costs_on_cuda_time_every_layer_and_both_predictions():
    """benchmarks/exp31_table.py --measure-paper-shape --device cuda's measurement, at a small shape: every layer's
    forward and backward and both predictions timed on the GPU (positive, finite)."""
    from benchmarks.paci_at_depth import layer_costs, parse_args

    config = vars(parse_args(["--layers", "1", "--dim", "256", "--block", "128", "--stages", "1"]))
    costs = layer_costs({**config, "cost_device": "cuda"}, repeats=2)
    assert set(costs) == {"forward", "backward", "predict", "predict_compiled", "predict_gpu", "predict_compiled_gpu"}
    assert all(len(v) == 3 and all(0 < t < 60 for t in v) for v in costs.values()), costs
