"""One short GPU check: the decode-step profile and `bench offline` waves at 1, 64 and 256 sequences for the
GPT-2, Llama-3.2-1B and Llama-3-8B shapes, with random weights (`--load-format dummy`); one JSON, one table.
Side by side on each shape: single steps with the greedy decode variant, the same with the full sampler,
and multi-step decoding (the ladder's `num_scheduler_steps`).

Run through `scripts/gpu_check.sh` (which prepares the model directories and the wheels the GPU image
lacks); `--cpu` runs the same code with tiny shapes and levels on this machine, so the script has run
before it is trusted with GPU minutes. Each shape is measured in parts, and the report (JSON and table) is
written after every part; a shape is skipped when the time left (`--budget-s`) could not hold it, and a part
that would start past the budget is skipped, so a run cut short still reports what it measured.

    python benchmarks/gpu_check.py --models DIR... --out OUT [--cpu] [--budget-s 330] [--enforce-eager]

`--enforce-eager` measures the steps as `serve --enforce-eager` compiles them, without CUDA graphs (XLA's
command buffers): beside a run without it, what the command buffers save per step.
"""

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

LEVELS = (1, 64, 256)
CPU_LEVELS = (1, 4)


def run_shape(model: str, ladder: Path, levels: tuple[int, ...], input_len: int, output_len: int,
              profile_steps: int, quantization: str | None, deadline: float,
              keep: Callable[[dict], None], enforce_eager: bool = False) -> dict:
    """Measures one shape in parts, the most telling first, each at every level; after each level `keep` gets
    the result so far (a run stopped from outside keeps it), and no part but the first starts after
    `deadline` (time.monotonic())."""
    import numpy as np

    from jaxserve.bench import step_profile
    from jaxserve.bench.offline import run_wave
    from jaxserve.config import EngineConfig
    from jaxserve.engine.llm_engine import LLMEngine

    start = time.perf_counter()
    engine = LLMEngine(EngineConfig.from_preset(ladder, model=model, load_format="dummy", compilation_cache_dir="",
                                                quantization=quantization, enforce_eager=enforce_eager))
    profiler = step_profile.StepProfiler(engine)
    runner = engine.runner
    # The ladder's k. Each engine step sets the scheduler's k from the runner's (`decode_steps_ready`), so the
    # single-step parts set the runner's: before stop 66's fix they set the scheduler's, and ran k-step decodes.
    multi_steps = runner.num_decode_steps
    rng = np.random.default_rng(0)
    result = {
        "model": model, "quantization": quantization, "dtype": engine.info.dtype,
        "startup_s": round(time.perf_counter() - start, 1), "warmup_s": round(engine.warmup_seconds, 1),
        "async_scheduling": engine.async_scheduling, "num_scheduler_steps": multi_steps, "skipped_parts": [],
        "enforce_eager": enforce_eager,
    }

    def single_steps(greedy: bool) -> None:
        runner.num_decode_steps, runner.greedy_decodes = 1, greedy

    def multi_step() -> None:
        runner.num_decode_steps, runner.greedy_decodes = multi_steps, True

    def profile(steps: int) -> Callable[[int], dict]:
        return lambda level: step_profile.as_dicts([profiler.profile(level, input_len, steps)])[0]

    def wave(level: int, repetition_penalty: float = 1.0) -> dict:
        return run_wave(engine, level, input_len, output_len, rng, repetition_penalty).__dict__

    # (name, setting, one level's measure): greedy single steps' profile (the step's breakdown), their waves
    # (TPOT), the multi-step decodes' waves, plain and with a repetition penalty (Qwen2.5's generation config
    # sets 1.05 for every request: the full sampler's k steps, the penalty counted on the device), then the
    # full sampler's and the multi-step decodes' profiles
    parts = [("profiles", lambda: single_steps(True), profile(profile_steps)),  # the greedy variant
             ("waves", lambda: single_steps(True), wave),
             ("waves_multi_step", multi_step, wave),
             ("waves_multi_step_penalty", multi_step, lambda level: wave(level, repetition_penalty=1.05)),
             ("profiles_full_sampler", lambda: single_steps(False), profile(profile_steps)),
             ("profiles_multi_step", multi_step, profile(max(2, profile_steps // multi_steps)))]
    try:
        for index, (name, setting, measure) in enumerate(parts):
            if index > 0 and time.monotonic() > deadline:  # a shape started gets its first part
                result["skipped_parts"].append(name)
                continue
            setting()
            if name == "waves":
                run_wave(engine, 1, input_len, 4, rng)  # every code path once before timing
            result[name] = []
            for level in levels:  # kept level by level: an error at 256 sequences keeps 1 and 64
                result[name].append(measure(level))
                if name == "profiles" and "device" not in result:
                    result["device"] = result["profiles"][0]["device"]
                result["greedy_steps"], result["multi_step_calls"] = runner.num_greedy_steps, runner.num_multi_steps
                keep(result)
    finally:
        try:
            engine.shutdown()
        except Exception:  # the measurement's own error, if any, is the one to report
            logging.exception("%s: the engine's shutdown failed", model)
    return result


def table(results: list[dict]) -> str:
    """Rows per shape and level; a part not measured (skipped for time, or the run stopped) shows as '-'."""
    lines = ["| shape | seqs | out tok/s (k steps; with a penalty) | TPOT ms (k steps; with a penalty) "
             "| step ms (full sampler; k steps) | host ms "
             "| dispatch ms | device ms | gap ms | kernels | roofline ms | fraction (k steps) |", "|---" * 12 + "|"]

    def at(r: dict, part: str, i: int) -> dict:
        return r[part][i] if len(r.get(part, [])) > i else {}

    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    for r in results:
        for i in range(max(len(r.get(part, [])) for part in ("profiles", "waves"))):
            profile, wave = at(r, "profiles", i), at(r, "waves", i)
            full, multi, wave_multi = at(r, "profiles_full_sampler", i), at(r, "profiles_multi_step", i), \
                at(r, "waves_multi_step", i)
            penalized = at(r, "waves_multi_step_penalty", i)
            m = profile.get("median_ms", {})
            lines.append(
                f"| {Path(r['model']).name}{' ' + r['quantization'] if r.get('quantization') else ''} "
                f"| {wave.get('concurrency', profile.get('concurrency'))} "
                f"| {fmt(wave.get('output_tokens_per_s'), ',.0f')} "
                f"({fmt(wave_multi.get('output_tokens_per_s'), ',.0f')}; "
                f"{fmt(penalized.get('output_tokens_per_s'), ',.0f')}) "
                f"| {fmt(wave.get('mean_tpot_ms'), '.2f')} ({fmt(wave_multi.get('mean_tpot_ms'), '.2f')}; "
                f"{fmt(penalized.get('mean_tpot_ms'), '.2f')}) "
                f"| {fmt(m.get('step'), '.3f')} ({fmt(full.get('median_ms', {}).get('step'), '.3f')}; "
                f"{fmt(multi.get('median_ms', {}).get('step'), '.3f')}) | {fmt(m.get('host'), '.3f')} "
                f"| {fmt(m.get('dispatch'), '.3f')} | {fmt(m.get('device'), '.3f')} | {fmt(m.get('gap'), '.3f')} "
                f"| {profile.get('kernels_per_step') or '-'} | {profile.get('roofline_ms') or '-'} "
                f"| {fmt(profile.get('roofline_fraction'), '.0%')} ({fmt(multi.get('roofline_fraction'), '.0%')}) |")
    return "\n".join(lines)


def write_whole(path: Path, text: str) -> None:
    """Replaces `path` at once: a run killed mid-write leaves the last whole report."""
    partial = path.with_suffix(path.suffix + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", required=True, help="model directories (config.json + tokenizer)")
    parser.add_argument("--ladder", type=Path, default=Path(__file__).with_name("gpu_check_ladder.yaml"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cpu", action="store_true", help="tiny levels and lengths, for a run on this machine")
    parser.add_argument("--budget-s", type=float, default=330.0,
                        help="no shape, and no part of one but its first, starts after this many seconds")
    parser.add_argument("--quantizations", nargs="+", default=["none"], choices=["none", "fp8"],
                        help="each shape once per weight format, side by side (none: the checkpoint's dtype)")
    parser.add_argument("--enforce-eager", action="store_true", help="the steps without CUDA graphs, as serve's flag")
    args = parser.parse_args()
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO,
                        stream=sys.stderr)
    levels, input_len, output_len, steps = (CPU_LEVELS, 16, 16, 8) if args.cpu else (LEVELS, 128, 128, 24)
    args.out.mkdir(parents=True, exist_ok=True)
    start, results, skipped = time.monotonic(), [], []
    deadline = start + args.budget_s

    def write(final: bool = False) -> str:
        """The report so far, as JSON and as a table: after every part of every shape."""
        report = table(results)  # a shape that failed part-way keeps the rows it measured
        failed = [f"{r['model']}: {r['error']}" for r in results if "error" in r]
        parts = [f"{r['model']}: {', '.join(r['skipped_parts'])}" for r in results if r.get("skipped_parts")]
        text = (report + "".join(f"\nfailed: {f}" for f in failed) + "".join(f"\nskipped (time): {s}" for s in skipped)
                + "".join(f"\nparts skipped (time): {p}" for p in parts) + ("" if final else "\n(run in progress)"))
        write_whole(args.out / "gpu_check.md", text + "\n")
        write_whole(args.out / "gpu_check.json", json.dumps({"results": results, "skipped": skipped}, indent=2))
        return text

    for model, quantization in ((m, q) for m in args.models for q in args.quantizations):
        elapsed = time.monotonic() - start
        # Shapes are run smallest first; the next is started only if the last one's time fits again.
        last = results[-1]["seconds"] if results else 0.0
        if elapsed + last > args.budget_s:
            skipped.append(f"{model} ({quantization})")
            continue
        began = time.monotonic()
        results.append({"model": model, "quantization": None if quantization == "none" else quantization})

        def keep(partial: dict, began: float = began) -> None:
            results[-1] = {**partial, "seconds": round(time.monotonic() - began, 1)}
            write()

        try:
            result = run_shape(model, args.ladder, levels, input_len, output_len, steps,
                               None if quantization == "none" else quantization, deadline, keep, args.enforce_eager)
        except Exception as e:  # one shape failing (out of memory, say) must not lose the others' figures
            logging.exception("%s failed", model)
            result = {**results[-1], "model": model, "error": repr(e)}
        results[-1] = {**result, "seconds": round(time.monotonic() - began, 1)}
        write()
    print(write(final=True))


if __name__ == "__main__":
    main()
