"""One short GPU check: the decode-step profile and `bench offline` waves at 1, 64 and 256 sequences for the
GPT-2, Llama-3.2-1B and Llama-3-8B shapes, with random weights (`--load-format dummy`); one JSON, one table.
Side by side on each shape: single steps with the greedy decode variant, the same with the full sampler,
and multi-step decoding (the ladder's `num_scheduler_steps`).

Run through `scripts/gpu_check.sh` (which prepares the model directories and the wheels the GPU image
lacks); `--cpu` runs the same code with tiny shapes and levels on this machine, so the script has run
before it is trusted with GPU minutes. Each shape's results are written as soon as they are known, and a
shape is skipped when the time left (`--budget-s`) could not hold it, so a run cut short still reports.

    python benchmarks/gpu_check.py --models DIR... --out OUT [--cpu] [--budget-s 330]
"""

import argparse
import json
import logging
import sys
import time
from pathlib import Path

LEVELS = (1, 64, 256)
CPU_LEVELS = (1, 4)


def run_shape(model: str, ladder: Path, levels: tuple[int, ...], input_len: int, output_len: int,
              profile_steps: int, quantization: str | None = None) -> dict:
    import numpy as np

    from jaxserve.bench import step_profile
    from jaxserve.bench.offline import run_wave
    from jaxserve.config import EngineConfig
    from jaxserve.engine.llm_engine import LLMEngine

    start = time.perf_counter()
    engine = LLMEngine(EngineConfig.from_preset(ladder, model=model, load_format="dummy",
                                                compilation_cache_dir="", quantization=quantization))
    startup = time.perf_counter() - start
    profiler = step_profile.StepProfiler(engine)
    scheduler, runner = engine.scheduler, engine.runner
    multi_steps = scheduler.num_scheduler_steps  # the ladder's k; 1 while the single-step loop is measured
    scheduler.num_scheduler_steps = 1
    profiles = [profiler.profile(c, input_len, profile_steps) for c in levels]
    greedy_steps = runner.num_greedy_steps
    runner.greedy_decodes = False  # the same steps through the full sampler, side by side
    full_sampler = [profiler.profile(c, input_len, profile_steps) for c in levels]
    runner.greedy_decodes = True
    scheduler.num_scheduler_steps = multi_steps  # k decode steps per call (greedy variant)
    multi_step = [profiler.profile(c, input_len, max(2, profile_steps // multi_steps)) for c in levels]
    rng = np.random.default_rng(0)
    run_wave(engine, 1, input_len, 4, rng)  # every code path once before timing
    waves_multi_step = [run_wave(engine, c, input_len, output_len, rng) for c in levels]
    scheduler.num_scheduler_steps = 1
    waves = [run_wave(engine, c, input_len, output_len, rng) for c in levels]
    result = {
        "model": model, "quantization": quantization, "dtype": engine.info.dtype, "device": profiles[0].device,
        "startup_s": round(startup, 1),
        "warmup_s": round(engine.warmup_seconds, 1), "async_scheduling": engine.async_scheduling,
        "profiles": step_profile.as_dicts(profiles),  # greedy variant (`greedy_decodes` in the ladder)
        "greedy_steps": greedy_steps,
        "profiles_full_sampler": step_profile.as_dicts(full_sampler),
        "num_scheduler_steps": multi_steps, "multi_step_calls": runner.num_multi_steps,
        "profiles_multi_step": step_profile.as_dicts(multi_step),  # per decode step
        "waves": [w.__dict__ for w in waves],
        "waves_multi_step": [w.__dict__ for w in waves_multi_step],
    }
    engine.shutdown()
    return result


def table(results: list[dict]) -> str:
    lines = ["| shape | seqs | out tok/s (k steps) | TPOT ms (k steps) | step ms (full sampler; k steps) | host ms "
             "| dispatch ms | device ms | gap ms | kernels | roofline ms | fraction (k steps) |", "|---" * 12 + "|"]
    for r in results:
        for profile, full, multi, wave, wave_multi in zip(r["profiles"], r["profiles_full_sampler"],
                                                           r["profiles_multi_step"], r["waves"],
                                                           r["waves_multi_step"], strict=True):
            m = profile["median_ms"]
            fraction, multi_fraction = profile["roofline_fraction"], multi["roofline_fraction"]
            lines.append(
                f"| {Path(r['model']).name}{' ' + r['quantization'] if r.get('quantization') else ''} "
                f"| {wave['concurrency']} | {wave['output_tokens_per_s']:,.0f} "
                f"({wave_multi['output_tokens_per_s']:,.0f}) | {wave['mean_tpot_ms']:.2f} "
                f"({wave_multi['mean_tpot_ms']:.2f}) | {m['step']:.3f} ({full['median_ms']['step']:.3f}; "
                f"{multi['median_ms']['step']:.3f}) | {m['host']:.3f} | {m['dispatch']:.3f} | {m['device']:.3f} | "
                f"{m['gap']:.3f} | {profile['kernels_per_step'] or '-'} | {profile['roofline_ms'] or '-'} | "
                f"{'-' if fraction is None else f'{fraction:.0%}'} "
                f"({'-' if multi_fraction is None else f'{multi_fraction:.0%}'}) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", required=True, help="model directories (config.json + tokenizer)")
    parser.add_argument("--ladder", type=Path, default=Path(__file__).with_name("gpu_check_ladder.yaml"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cpu", action="store_true", help="tiny levels and lengths, for a run on this machine")
    parser.add_argument("--budget-s", type=float, default=330.0, help="skip a shape that would start after this")
    parser.add_argument("--quantizations", nargs="+", default=["none"], choices=["none", "fp8"],
                        help="each shape once per weight format, side by side (none: the checkpoint's dtype)")
    args = parser.parse_args()
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO,
                        stream=sys.stderr)
    levels, input_len, output_len, steps = (CPU_LEVELS, 16, 16, 8) if args.cpu else (LEVELS, 128, 128, 24)
    args.out.mkdir(parents=True, exist_ok=True)
    start, results, skipped = time.monotonic(), [], []
    for model, quantization in ((m, q) for m in args.models for q in args.quantizations):
        elapsed = time.monotonic() - start
        # Shapes are run smallest first; the next is started only if the last one's time fits again.
        last = results[-1]["seconds"] if results else 0.0
        if elapsed + last > args.budget_s:
            skipped.append(f"{model} ({quantization})")
            continue
        began = time.monotonic()
        try:
            result = run_shape(model, args.ladder, levels, input_len, output_len, steps,
                               None if quantization == "none" else quantization)
        except Exception as e:  # one shape failing (out of memory, say) must not lose the others' figures
            logging.exception("%s failed", model)
            result = {"model": model, "error": repr(e), "profiles": [], "waves": []}
        result["seconds"] = round(time.monotonic() - began, 1)
        results.append(result)
        (args.out / "gpu_check.json").write_text(json.dumps({"results": results, "skipped": skipped}, indent=2))
    report = table([r for r in results if "error" not in r])
    failed = [f"{r['model']}: {r['error']}" for r in results if "error" in r]
    text = report + "".join(f"\nfailed: {f}" for f in failed) + "".join(f"\nskipped (time): {s}" for s in skipped)
    (args.out / "gpu_check.md").write_text(text + "\n")
    (args.out / "gpu_check.json").write_text(json.dumps({"results": results, "skipped": skipped}, indent=2))
    print(text)


if __name__ == "__main__":
    main()
