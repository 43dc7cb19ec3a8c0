"""`jaxserve bench buckets`: padding accounting, the simulation against the real engine, --suggest, output."""

import subprocess
import sys

import pytest

from jaxserve.bench.ladder_run import StepRecord, padding, run_engine, simulate
from jaxserve.bench.ladders import LadderSpec, load_ladder, make_objective, powers_of_two, suggest_ladder
from jaxserve.bench.workload import TraceRequest, Workload, make_workload
from jaxserve.cli import main
from jaxserve.runner.buckets import Bucket

SMALL = LadderSpec("small", (16, 32), (1, 2, 4), 32, 4, page_size=4)


def test_padding_accounting_is_exact_on_a_hand_made_trace():
    # Two 10-token prompts together (20 tokens in a 32 x 2 bucket), two decode steps (2 x 2), then the
    # third request alone: 5 tokens in 16 x 1, two decodes in 1 x 1. Each request makes 3 tokens.
    workload = Workload("hand", (TraceRequest(10, 3), TraceRequest(10, 3), TraceRequest(5, 3)), concurrency=2)
    run = simulate(workload, SMALL.ladder(), SMALL.max_num_seqs, SMALL.max_num_batched_tokens, 64, 4)
    assert [(s.bucket, s.num_tokens, s.num_reqs) for s in run.steps] == [
        (Bucket(32, 2), 20, 2), (Bucket(2, 2, True), 2, 2), (Bucket(2, 2, True), 2, 2),
        (Bucket(16, 1), 5, 1), (Bucket(1, 1, True), 1, 1), (Bucket(1, 1, True), 1, 1)]
    waste = padding(run.steps)
    assert waste["mixed"]["padded_tokens"] == 12 + 11 and waste["mixed"]["token_waste"] == 23 / 25
    assert waste["mixed"]["mean_step_token_waste"] == pytest.approx((12 / 20 + 11 / 5) / 2)
    assert waste["decode"]["token_waste"] == 0.0 and waste["decode"]["steps"] == 4
    assert waste["all"]["token_waste"] == 23 / 31 and waste["all"]["row_waste"] == 0.0
    # Unit step times: the third request arrives at t = 3, its first token at t = 4, its last at 6.
    assert run.ttft_s == [1, 1, 1] and run.e2e_s == [3, 3, 3] and run.tpot_s == [1, 1, 1]
    rows = padding([StepRecord(Bucket(4, 4, True), 3, 3, 1.0)])
    assert rows["decode"]["row_waste"] == 1 / 3 and rows["decode"]["token_waste"] == 1 / 3


def test_the_simulation_picks_the_engines_bucket_step_by_step(llama_dir):
    from tests.engine.helpers import LADDER, make_engine

    engine = make_engine(llama_dir, enable_prefix_caching=False)
    workload = make_workload("uniform:3-70,1-12", num_requests=14, concurrency=5, max_model_len=256, seed=3)
    measured = run_engine(engine, workload)
    spec = LadderSpec("engine", LADDER["token_buckets"], LADDER["request_buckets"], LADDER["max_num_batched_tokens"],
                      LADDER["max_num_seqs"], page_size=4)
    simulated = simulate(workload, spec.ladder(), spec.max_num_seqs, spec.max_num_batched_tokens,
                         engine.kv_cache.num_pages, 4)
    assert [(s.bucket, s.num_tokens, s.num_reqs) for s in measured.steps] == [
        (s.bucket, s.num_tokens, s.num_reqs) for s in simulated.steps]
    assert any(s.decode_only for s in measured.steps) and any(not s.decode_only for s in measured.steps)
    assert measured.num_output_tokens == simulated.num_output_tokens == workload.num_output_tokens


def toy_seconds(bucket: Bucket, num_keys: int) -> float:
    """A device where padding costs: a launch, per padded token and row, and per key read."""
    return 1e-3 + 2e-6 * bucket.num_tokens + 1e-5 * bucket.num_reqs + 1e-8 * num_keys


@pytest.mark.parametrize("step_seconds", [None, toy_seconds], ids=["padding", "predicted"])
def test_suggest_stays_within_budget_and_beats_powers_of_two(step_seconds):
    pow2 = LadderSpec("pow2", powers_of_two(512, 32), powers_of_two(64), 512, 64)
    workload = make_workload("sharegpt", num_requests=120, concurrency=24, seed=1)
    steps = simulate(workload, pow2.ladder(), 64, 512, 10**5, 16).steps
    score = make_objective(steps, step_seconds)
    for budget in (pow2.num_buckets, 12):
        suggested, suggested_score = suggest_ladder(pow2, steps, budget, step_seconds)
        assert suggested.num_buckets <= budget
        assert suggested_score == score(suggested)
        if budget >= pow2.num_buckets:
            assert suggested_score <= score(pow2)
        assert suggested.max_num_batched_tokens == 512 and suggested.max_num_seqs == 64


def test_bundled_ladders_load():
    counts = {name: load_ladder(name).num_buckets for name in ("buckets/pow2", "buckets/linear-gap", "buckets/sparse")}
    assert counts["buckets/sparse"] < counts["buckets/pow2"] < counts["buckets/linear-gap"]


def test_the_command_writes_results_plots_and_a_suggestion(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    main(["bench", "buckets", "--config", "buckets/pow2", "--config", "buckets/sparse",
          "--config", "tokens=64,256,512;requests=1,8,32,64", "--workload", "sharegpt", "--num-requests", "60",
          "--concurrency", "16", "--target", "h100", "--model", "gpt2", "--suggest", "--max-buckets", "16",
          "--out", str(out)])
    printed = capsys.readouterr().out
    assert "PREDICTED" in printed and "suggested" in printed
    for name in ("results.json", "results.csv", "report.md", "suggested.yaml", "padding.png", "pareto.png",
                 "buckets.png"):
        assert (out / name).stat().st_size > 0, name
    suggested = load_ladder(str(out / "suggested.yaml"))
    assert suggested.num_buckets <= 16
    assert "![padding](padding.png)" in (out / "report.md").read_text()


def test_the_command_works_without_matplotlib(tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from jaxserve.cli import main\n"
            f"main(['bench', 'buckets', '--config', 'buckets/sparse', '--workload', 'fixed:100,20', "
            f"'--num-requests', '20', '--rate', '5', '--out', {str(tmp_path)!r}])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "report.md").is_file() and not list(tmp_path.glob("*.png"))
    assert "buckets/sparse" in result.stdout
