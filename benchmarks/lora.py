"""What serving LoRA adapters costs, side by side in one run: the bundled model's engine without LoRA, and
with `--enable-lora` at `--max-loras 1` and 4 (rank 16 slots) serving requests of the base model, of one
adapter, and of four adapters mixed in every step. The adapters are random, rank 16, on all seven
projections.

Each round runs every case once, in turn (alternating, so drift hits all alike): `--streams` greedy requests
of `--input-len` random prompt tokens and `--output-len` new tokens each, submitted at once. Reported per
case and stream count: output tok/s (median of the rounds) and its ratio to the engine without LoRA.

    python benchmarks/lora.py --streams 1 16 --rounds 3
    # a GPU, the 8B shape with random weights, three engines sharing its memory:
    python benchmarks/lora.py --config gpu --model .gpu_check/llama-3-8b --load-format dummy \
        --gpu-memory-utilization 0.28 --streams 1 16 64
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.model_configs import bundled_config_values
from jaxserve.sampling_params import SamplingParams

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(directory: Path, config: dict, rank: int, seed: int) -> Path:
    """A random PEFT adapter of `rank` on every projection of a Llama-family model with `config`."""
    d, f = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or d // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {"self_attn.q_proj": (d, q), "self_attn.k_proj": (d, kv), "self_attn.v_proj": (d, kv),
              "self_attn.o_proj": (q, d), "mlp.gate_proj": (d, f), "mlp.up_proj": (d, f), "mlp.down_proj": (f, d)}
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (in_dim, out_dim) in shapes.items():
            stem = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{stem}.lora_A.weight"] = rng.normal(0, 0.02, (rank, in_dim)).astype(np.float32)
            tensors[f"{stem}.lora_B.weight"] = rng.normal(0, 0.02, (out_dim, rank)).astype(np.float32)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "adapter_model.safetensors")
    (directory / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 2 * rank,
                                                                "target_modules": list(TARGETS)}))
    return directory


def run_once(engine: LLMEngine, adapters: list[str | None], streams: int, input_len: int, output_len: int,
             seed: int) -> float:
    """Output tok/s of `streams` requests submitted at once, request i of adapters[i % len(adapters)]."""
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    for i in range(streams):
        prompt = rng.integers(100, 40000, size=input_len).tolist()
        engine.add_request(f"{seed}-{i}", prompt, params, lora_name=adapters[i % len(adapters)])
    while engine.has_unfinished_requests():
        engine.step()
    return streams * output_len / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--config", default="cpu", help="the engine preset (default: cpu)")
    parser.add_argument("--model", help="a model directory (default: the bundled SmolLM2)")
    parser.add_argument("--load-format", default="auto", help="auto, or dummy: random weights")
    parser.add_argument("--gpu-memory-utilization", type=float, help="each engine's share of a GPU's memory")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()

    model_config = (bundled_config_values("smollm2-135m") if args.model is None
                    else json.loads((Path(args.model) / "config.json").read_text()))
    engine_args = dict(model=args.model, load_format=args.load_format,
                       gpu_memory_utilization=args.gpu_memory_utilization)
    work = Path(tempfile.mkdtemp(prefix="jaxserve-lora-bench-"))
    names = [f"a{i}" for i in range(4)]
    modules = tuple(f"{name}={write_adapter(work / name, model_config, args.rank, i)}" for i, name in enumerate(names))
    plain = LLMEngine(EngineConfig.from_preset(args.config, **engine_args))
    one, four = (LLMEngine(EngineConfig.from_preset(args.config, enable_lora=True, lora_modules=modules,
                                                    max_loras=slots, max_lora_rank=args.rank, **engine_args))
                 for slots in (1, 4))
    cases = {"no LoRA": (plain, [None]), "1 slot, base requests": (one, [None]),
             "1 slot, one adapter": (one, names[:1]), "4 slots, base requests": (four, [None]),
             "4 slots, one adapter": (four, names[:1]),
             "4 slots, four adapters": (four, names)}
    for engine, adapters in cases.values():  # compile what each runs, and write the slots
        run_once(engine, adapters, max(args.streams), 8, 4, seed=10**6)
    results: dict[str, dict[int, list[float]]] = {case: {s: [] for s in args.streams} for case in cases}
    for round_ in range(args.rounds):
        for streams in args.streams:
            for case, (engine, adapters) in cases.items():
                results[case][streams].append(run_once(engine, adapters, streams, args.input_len, args.output_len,
                                                       seed=round_ * 100 + streams))
    table = []
    for streams in args.streams:
        base = statistics.median(results["no LoRA"][streams])
        for case in cases:
            median = statistics.median(results[case][streams])
            table.append({"streams": streams, "case": case, "tok_s": round(median, 1), "ratio": round(median / base, 3),
                          "rounds": [round(x, 1) for x in results[case][streams]]})
            print(f"{streams:>3} streams  {case:<24} {median:8.1f} tok/s  {median / base:5.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": table}, indent=2) + "\n")


if __name__ == "__main__":
    main()
