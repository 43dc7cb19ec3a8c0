"""`jaxserve bench buckets`: compare bucket ladders on a workload, here and predicted on a GPU target.

For each ladder: its compiled bucket count; padding waste on the workload (from the simulated run,
which picks exactly the buckets the engine picks); predicted throughput and latency on `--target` for
`--model` (simulated steps timed by the roofline of jaxserve/bench/predict.py); and with `--measure`,
the engine on this machine: warm-up seconds with a cold and a warm compilation cache, then the trace
itself (output tok/s, TTFT, TPOT, E2E). Writes a table to stdout and results.json, results.csv, PNG
plots (matplotlib, the optional `bench` extra, imported only to plot) and report.md to `--out`.
"""

import csv
import json
import logging
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from jaxserve.bench.ladder_run import run_engine, simulate
from jaxserve.bench.ladders import LadderSpec, load_ladder, suggest_ladder
from jaxserve.bench.workload import Workload, make_workload
from jaxserve.config import BucketBenchConfig
from jaxserve.runner.buckets import Bucket

logger = logging.getLogger(__name__)


def _no_preemption_pages(spec: LadderSpec, workload: Workload) -> int:
    """Enough pages for every running request's longest sequence: the simulation assumes a KV cache
    that never preempts (the engine's own budget decides that when measured)."""
    longest = max(r.prompt_len + r.output_len for r in workload.requests)
    return spec.max_num_seqs * -(-longest // spec.page_size) + 1


def evaluate_ladder(
    spec: LadderSpec,
    workload: Workload,
    step_seconds: Callable[[Bucket, int], float] | None = None,
    measure: Callable[[LadderSpec, Workload], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    pages = _no_preemption_pages(spec, workload)
    args = (workload, spec.ladder(), spec.max_num_seqs, spec.max_num_batched_tokens, pages, spec.page_size)
    steps = simulate(*args)  # unit step times: the steps and buckets, independent of any device
    result: dict[str, Any] = {"ladder": asdict(spec), "name": spec.name, "num_buckets": spec.num_buckets,
                              "padding": steps.summary()["padding"], "bucket_steps": steps.summary()["bucket_steps"],
                              "num_steps": len(steps.steps)}
    if step_seconds is not None:
        result["predicted"] = simulate(*args, step_seconds=step_seconds).summary()
    if measure is not None:
        result["measured"] = measure(spec, workload)
    return result


def engine_measurement(model: str | None, dtype: str, max_model_len: int,
                       load_format: str = "auto") -> Callable[[LadderSpec, Workload], dict]:
    """Builds the engine for a ladder twice (empty, then filled compilation cache) and runs the trace."""
    from jaxserve.config import EngineConfig
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.models.loader import load_model

    loaded: dict[str, Any] = {}

    def measure(spec: LadderSpec, workload: Workload) -> dict[str, Any]:
        import jax
        from jax.experimental.compilation_cache import compilation_cache

        with tempfile.TemporaryDirectory(prefix="jaxserve-bench-xla-") as cache_dir:
            # JAX opens its persistent cache once per process: reopen it on this ladder's empty directory.
            compilation_cache.reset_cache()
            jax.clear_caches()
            config = EngineConfig.from_preset(
                None, model=model, dtype=dtype, max_model_len=max_model_len, compilation_cache_dir=cache_dir,
                token_buckets=spec.token_buckets, request_buckets=spec.request_buckets,
                max_num_batched_tokens=spec.max_num_batched_tokens, max_num_seqs=spec.max_num_seqs,
                page_size=spec.page_size, enable_prefix_caching=False,
            )
            if "model" not in loaded:
                loaded["model"] = load_model(config.model.model, config.model.dtype, config.attention_impl,
                                             load_format=load_format)
            cold = LLMEngine(config, model=loaded["model"]).warmup_seconds
            jax.clear_caches()  # in-memory executables gone: the second engine reads the persistent cache
            engine = LLMEngine(config, model=loaded["model"])
            warm = engine.warmup_seconds
            run = run_engine(engine, workload).summary()
        return {"warmup_cold_s": cold, "warmup_warm_s": warm, **run}

    return measure


def format_table(results: list[dict[str, Any]]) -> str:
    head = f"{'ladder':<22} {'buckets':>7} {'tok waste d/m/all':>19} {'row waste':>9}"
    measured = any("measured" in r for r in results)
    predicted = any("predicted" in r for r in results)
    if measured:
        head += f" {'warm-up c/w s':>13} {'out tok/s':>9} {'TTFT p50':>9} {'TPOT p50':>9} {'E2E p50':>9}"
    if predicted:
        head += f" {'pred tok/s':>10} {'pTTFT p50':>9} {'pTPOT p50':>9} {'pE2E p50':>9}"
    lines = [head]
    for r in results:
        pad = r["padding"]
        row = (f"{r['name'][:22]:<22} {r['num_buckets']:>7} "
               f"{pad['decode']['token_waste']:>6.2f}/{pad['mixed']['token_waste']:>5.2f}/{pad['all']['token_waste']:>5.2f}"
               f" {pad['all']['row_waste']:>9.2f}")
        for key, on in (("measured", measured), ("predicted", predicted)):
            if not on:
                continue
            m = r.get(key)
            if m is None:
                row += " " * (53 if key == "measured" else 40)
                continue
            if key == "measured":
                row += f" {m['warmup_cold_s']:>6.1f}/{m['warmup_warm_s']:>6.1f}"
            row += (f" {m['output_tokens_per_s']:>{9 if key == 'measured' else 10}.1f} {m['ttft_ms']['p50']:>9.1f}"
                    f" {m['tpot_ms']['p50']:>9.2f} {m['e2e_ms']['p50']:>9.1f}")
        lines.append(row)
    notes = ["token waste: padded tokens / real tokens (decode-only / mixed / all steps); row waste: padded "
             "rows / real rows; latencies in ms"]
    if predicted:
        notes.append("pred*: PREDICTED on the GPU target by a roofline (a lower bound), not measured")
    return "\n".join(lines + notes)


def write_csv(results: list[dict[str, Any]], path: Path) -> None:
    rows = []
    for r in results:
        row: dict[str, Any] = {"ladder": r["name"], "num_buckets": r["num_buckets"], "num_steps": r["num_steps"],
                               "token_buckets": " ".join(map(str, r["ladder"]["token_buckets"])),
                               "request_buckets": " ".join(map(str, r["ladder"]["request_buckets"]))}
        for group, values in r["padding"].items():
            row.update({f"{group}_token_waste": values["token_waste"], f"{group}_row_waste": values["row_waste"]})
        for key in ("measured", "predicted"):
            if key in r:
                m = r[key]
                row[f"{key}_output_tokens_per_s"] = m["output_tokens_per_s"]
                for metric in ("ttft_ms", "tpot_ms", "e2e_ms"):
                    row.update({f"{key}_{metric}_{s}": m[metric][s] for s in ("mean", "p50", "p99")})
                if key == "measured":
                    row.update(warmup_cold_s=m["warmup_cold_s"], warmup_warm_s=m["warmup_warm_s"])
        rows.append(row)
    fields = list(dict.fromkeys(k for row in rows for k in row))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def plot(results: list[dict[str, Any]], out: Path) -> list[Path]:
    """PNG plots, or none (with a log line) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed (pip install 'jaxserve[bench]'): no plots")
        return []
    names = [r["name"] for r in results]
    paths = []

    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.27
    for i, group in enumerate(("decode", "mixed", "all")):
        ax.bar([x + (i - 1) * width for x in range(len(names))], [r["padding"][group]["token_waste"] for r in results],
               width, label=f"{group} steps")
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right")
    ax.set_ylabel("padded / real tokens")
    ax.set_title("Padding waste per ladder")
    ax.legend()
    paths.append(_save(fig, out / "padding.png"))

    key = "predicted" if all("predicted" in r for r in results) else "measured"
    if all(key in r for r in results):
        fig, ax = plt.subplots(figsize=(6, 4))
        points = sorted((r["num_buckets"], r[key]["output_tokens_per_s"], r["name"]) for r in results)
        ax.scatter([p[0] for p in points], [p[1] for p in points])
        for x, y, name in points:
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        front, best = [], -1.0
        for x, y, _ in points:  # fewest buckets first: a point is on the front if it beats all smaller ladders
            if y > best:
                front.append((x, y))
                best = y
        ax.plot([p[0] for p in front], [p[1] for p in front], "--", label="Pareto front")
        ax.set_xlabel("compiled buckets")
        ax.set_ylabel(f"{key} output tok/s")
        ax.set_title(f"Bucket count against throughput ({key})")
        ax.legend()
        paths.append(_save(fig, out / "pareto.png"))

    fig, axes = plt.subplots(len(results), 1, figsize=(8, 2.2 * len(results)), squeeze=False)
    for ax, r in zip(axes[:, 0], results, strict=True):
        top = list(r["bucket_steps"].items())[:16]
        ax.bar([k for k, _ in top], [v for _, v in top])
        ax.set_title(f"{r['name']}: steps per bucket (T x R, d = decode-only)", fontsize=9)
        ax.tick_params(axis="x", labelsize=7, rotation=30)
    paths.append(_save(fig, out / "buckets.png"))
    return paths


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def write_report(results: list[dict[str, Any]], workload: Workload, plots: list[Path], out: Path,
                 command: str, target: str | None) -> Path:
    lines = [f"# Bucket ladders on `{workload.name}`", "", f"Command: `{command}`", "",
             f"{len(workload.requests)} requests, {workload.num_prompt_tokens} prompt and "
             f"{workload.num_output_tokens} output tokens.", "", "```", format_table(results), "```", ""]
    if target:
        lines += [f"Predicted columns are a roofline on `{target}` (jaxserve/bench/predict.py): a lower bound, "
                  "not a measurement.", ""]
    lines += [f"![{p.stem}]({p.name})" for p in plots]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def run(
    specs: list[LadderSpec],
    workload: Workload,
    out: Path,
    step_seconds: Callable[[Bucket, int], float] | None = None,
    measure: Callable[[LadderSpec, Workload], dict[str, Any]] | None = None,
    suggest_budget: int | None = None,
    command: str = "",
    target: str | None = None,
) -> list[dict[str, Any]]:
    out.mkdir(parents=True, exist_ok=True)
    if suggest_budget is not None:
        base = max(specs, key=lambda s: (s.max_num_batched_tokens, s.max_num_seqs))
        steps = simulate(workload, base.ladder(), base.max_num_seqs, base.max_num_batched_tokens,
                         _no_preemption_pages(base, workload), base.page_size)
        start = time.perf_counter()
        suggested, score = suggest_ladder(base, steps.steps, suggest_budget, step_seconds)
        objective = "predicted seconds" if step_seconds else "padded tokens + rows"
        (out / "suggested.yaml").write_text(suggested.to_yaml(
            f"Suggested by `jaxserve bench buckets --suggest` for {workload.name}: at most {suggest_budget} buckets,\n"
            f"minimising {objective} (score {score:.4g}); step limits as {base.name}."))
        logger.info("suggested %s in %.1fs", suggested, time.perf_counter() - start)
        specs = [*specs, suggested]
    results = [evaluate_ladder(spec, workload, step_seconds, measure) for spec in specs]
    (out / "results.json").write_text(json.dumps({"workload": workload.name, "results": results}, indent=2))
    write_csv(results, out / "results.csv")
    plots = plot(results, out)
    write_report(results, workload, plots, out, command, target)
    return results


def main(config: BucketBenchConfig) -> None:
    """The command: the workload (a closed loop of 16 unless a rate or a concurrency is given; a .jsonl
    file's own arrivals unless a concurrency is), the predictions with a target, then `run`."""
    concurrency = config.concurrency if config.concurrency is not None or config.rate is not None else 16
    if config.workload.endswith(".jsonl") and config.concurrency is None:
        concurrency = None  # the file's own arrivals unless a loop is asked for
    workload = make_workload(config.workload, config.num_requests, config.rate, concurrency, config.max_model_len,
                             config.seed)
    step_seconds = None
    if config.target:
        from jaxserve.bench.predict import roofline_step_seconds

        step_seconds = roofline_step_seconds(config.model, config.target, config.dtype)
    measure = (engine_measurement(config.measure_model, config.dtype, config.max_model_len, config.load_format)
               if config.measure else None)
    results = run(
        [load_ladder(c) for c in config.ladders], workload, Path(config.out), step_seconds, measure,
        config.max_buckets if config.suggest else None, command="jaxserve " + " ".join(sys.argv[1:]),
        target=config.target,
    )
    print(f"{workload.name}: {len(workload.requests)} requests")
    print(format_table(results))
    print(f"results, plots and report in {config.out}/")
