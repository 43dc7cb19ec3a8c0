"""benchmarks/attention.py runs end to end (reference, dense, the kernel interpreted, and compiled on a
CUDA GPU) and agrees with the reference."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve.ops.attention import MIN_PALLAS_COMPUTE_CAPABILITY, cuda_compute_capability

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "attention.py"


@pytest.mark.slow  # runs benchmarks/attention.py in a subprocess
def test_attention_benchmark_smoke(tmp_path):
    out = tmp_path / "rows.json"
    command = [sys.executable, str(SCRIPT), "--impls", "pallas", "reference", "dense", "interpret",
               "--heads", "smollm2-135m", "--dtype", "float32", "--batch-sizes", "2", "--context-lens", "40",
               "--mixed", "none", "--iters", "1", "--calls-per-sample", "1", "--json", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    capability = cuda_compute_capability()
    kernel_runs = capability is not None and capability >= MIN_PALLAS_COMPUTE_CAPABILITY
    assert ("skipping the compiled kernel" in result.stdout) is not kernel_runs
    rows = json.loads(out.read_text())["rows"]
    assert [row["impl"] for row in rows] == ["pallas"] * kernel_runs + ["reference", "dense", "interpret"]
    # A GPU may run float32 matmuls in TF32 (about 1e-3 relative); a CPU computes them in full float32.
    tolerance = 5e-3 if capability is not None else 1e-5
    for row in rows:
        assert row["us_per_call"] > 0 and row["max_abs_err"] < tolerance
        if capability is None:
            assert row["peak_fraction"] is None  # a CPU has no HBM peak to compare with


@pytest.mark.slow  # runs benchmarks/attention.py in a subprocess
def test_attention_benchmark_reads_a_cache_of_keys_alone(tmp_path):
    """`--values-are-keys` (DeepSeek's latent cache): dense attention over the keys as values agrees with the
    reference path reading the keys' pages as values, and the ideal traffic counts the one array."""
    out = tmp_path / "rows.json"
    command = [sys.executable, str(SCRIPT), "--impls", "reference", "dense", "cpu", "--heads", "deepseek-v2-lite",
               "--dtype", "float32", "--values-are-keys", "--batch-sizes", "2", "--context-lens", "40", "--mixed",
               "none", "--iters", "1", "--calls-per-sample", "1", "--json", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [row["impl"] for row in rows] == ["reference", "dense", "cpu"]
    tolerance = 5e-3 if cuda_compute_capability() is not None else 1e-5
    for row in rows:
        assert row["max_abs_err"] < tolerance
        # 2 requests x 40 keys x 576 float32s, read once; the query and output of 16 heads
        ideal = 2 * 40 * 576 * 4 + 2 * 2 * 16 * 576 * 4
        assert abs(row["gb_per_s"] * 1e9 * row["us_per_call"] * 1e-6 - ideal) < 1e-3 * ideal
