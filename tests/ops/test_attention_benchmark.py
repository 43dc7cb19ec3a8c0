"""benchmarks/attention.py runs end to end on CPU (reference, dense, the kernel interpreted) and agrees."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "attention.py"


def test_attention_benchmark_smoke(tmp_path):
    out = tmp_path / "rows.json"
    command = [sys.executable, str(SCRIPT), "--impls", "pallas", "reference", "dense", "interpret",
               "--heads", "smollm2-135m", "--dtype", "float32", "--batch-sizes", "2", "--context-lens", "40",
               "--mixed", "none", "--iters", "1", "--calls-per-sample", "1", "--json", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "skipping the compiled kernel" in result.stdout  # no GPU in CI
    rows = json.loads(out.read_text())["rows"]
    assert [row["impl"] for row in rows] == ["reference", "dense", "interpret"]
    for row in rows:
        assert row["us_per_call"] > 0 and row["peak_fraction"] is None
        assert row["max_abs_err"] < 1e-5
