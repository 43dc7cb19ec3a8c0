"""Data parallelism side by side in one run: one engine core against `--data-parallel-size` ranks, the ranks'
requests routed by prefix (the default) or by load alone, on multi-turn conversations.

Each round runs every setting in turn (alternating, so drift hits all alike) on new conversations:
`--conversations` of `--turns` turns, all started at once. A conversation's first prompt is `--prompt-len`
random tokens of its own; each later turn's prompt is the last turn's prompt, its answer and `--turn-len`
new tokens (a chat client's history), sent after its user's thinking time (exponential, mean `--think-s`),
while other conversations' turns arrive. Greedy; a turn's answer is 0.5-1.5x `--output-len` tokens, drawn
per turn. Without the thinking time, a turn that ends frees a row on its own rank and routing by load alone
sends the next turn back there: a closed loop's affinity that real traffic does not have.
Every setting draws the same prompts, answer lengths and thinking times (one random stream per turn).
Reported per setting (medians of the rounds): output tok/s and its ratio to one core, mean TTFT, and the
prefix cache's hit rate (prompt tokens found cached, from the engine's counters).

    python benchmarks/data_parallel.py --rounds 3 --out docs/data-parallel-cpu.json
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.sampling_params import SamplingParams


def run_conversations(engine: LLMEngine, args: argparse.Namespace, seed: int) -> dict[str, float]:
    def turn_rng(c: int, turn: int) -> np.random.Generator:
        """One stream per turn: every setting draws the same prompts, answer lengths and thinking times."""
        return np.random.default_rng((seed, c, turn + 1))  # turn -1: the first prompt

    def add(c: int, turn: int) -> None:
        # Answers of different lengths: the conversations drift apart, as real ones do.
        max_tokens = int(turn_rng(c, turn).integers(args.output_len // 2, 3 * args.output_len // 2))
        engine.add_request(f"{seed}-{c}-{turn}", prompts[c], SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                             ignore_eos=True))

    before = engine.stats()
    prompts = {c: turn_rng(c, -1).integers(100, 40000, size=args.prompt_len).tolist()
               for c in range(args.conversations)}
    turns = dict.fromkeys(prompts, 0)
    due: list[tuple[float, int]] = []  # (when, conversation): next turns, each after its user's thinking
    ttfts, num_output = [], 0
    start = time.perf_counter()
    for c in prompts:
        add(c, 0)
    while engine.has_unfinished_requests() or due:
        now = time.perf_counter()
        for when, c in [item for item in due if item[0] <= now]:
            due.remove((when, c))
            add(c, turns[c])
        if not engine.has_unfinished_requests():
            time.sleep(0.001)
            continue
        for output in engine.step():
            if not output.finished:
                continue
            c = int(output.request_id.split("-")[1])
            ttfts.append(output.metrics.first_token_time - output.metrics.arrival_time)
            num_output += len(output.outputs[0].token_ids)
            turns[c] += 1
            if turns[c] < args.turns:
                rng = turn_rng(c, turns[c])
                prompts[c] = prompts[c] + list(output.outputs[0].token_ids) + rng.integers(
                    100, 40000, size=args.turn_len).tolist()
                due.append((time.perf_counter() + rng.exponential(args.think_s) if args.think_s else 0.0, c))
    seconds = time.perf_counter() - start
    after = engine.stats()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    return {"tok_s": num_output / seconds, "ttft_ms": 1000 * statistics.mean(ttfts),
            "hit_rate": (after.prefix_cache_hits - before.prefix_cache_hits) / max(queries, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--turn-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--think-s", type=float, default=1.0,
                        help="mean seconds between a turn's answer and the next turn (exponential; 0: at once)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--data-parallel-size", type=int, default=2)
    parser.add_argument("--sequential", action="store_true",
                        help="one engine at a time (devices that hold one), instead of all at once, alternating")
    parser.add_argument("--config", default="cpu", help="the engine preset (default: cpu)")
    parser.add_argument("--model", help="the model (default: the preset's, the bundled SmolLM2)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()

    def engine(**options) -> LLMEngine:
        return LLMEngine(EngineConfig.from_preset(args.config, model=args.model, max_model_len=2048, **options))

    def build(setting: str) -> LLMEngine:
        built = engine(engine_process=True) if setting == "1 core" else engine(data_parallel_size=dp)
        if setting.endswith("by load"):
            built._core.router.capacity = 0  # the router's prefix guesses off: by load alone, as vLLM's balancer
        warm_up = argparse.Namespace(**{**vars(args), "conversations": 4, "turns": 2, "think_s": 0})
        run_conversations(built, warm_up, seed=10**6)  # every bucket the conversations use, compiled and run
        return built

    dp = args.data_parallel_size
    names = ["1 core", f"{dp} ranks, by load", f"{dp} ranks, by prefix"]
    results: dict[str, list[dict]] = {name: [] for name in names}

    def measure(name: str, running: LLMEngine, round_: int) -> None:
        results[name].append(run_conversations(running, args, seed=round_))
        print(f"round {round_}: {name:<20} " + "  ".join(f"{k} {v:.3f}" for k, v in results[name][-1].items()),
              flush=True)

    if args.sequential:  # one engine at a time, all its rounds
        for name in names:
            running = build(name)
            for round_ in range(args.rounds):
                measure(name, running, round_)
            running.shutdown()
    else:  # all engines at once, the rounds alternating between them
        settings = {name: build(name) for name in names}
        for round_ in range(args.rounds):
            for name, running in settings.items():
                measure(name, running, round_)
        for running in settings.values():
            running.shutdown()
    base = statistics.median(r["tok_s"] for r in results["1 core"])
    table = []
    for name, rounds in results.items():
        row = {key: round(statistics.median(r[key] for r in rounds), 3) for key in rounds[0]}
        row.update(setting=name, ratio=round(row["tok_s"] / base, 3))
        table.append(row)
        print(f"{name:<20} {row['tok_s']:8.1f} tok/s  {row['ratio']:5.2f}x  TTFT {row['ttft_ms']:7.1f} ms  "
              f"prefix hits {row['hit_rate']:.1%}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": table, "rounds": results}, indent=2)
                                  + "\n")


if __name__ == "__main__":
    main()
