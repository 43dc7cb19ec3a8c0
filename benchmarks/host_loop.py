"""Host time per engine step: everything but the device, at 64 and 256 running sequences.

A GPU runs GPT-2's decode step in a few milliseconds, so the host's share of a step (scheduling,
building the batch, dispatching the executable, reading the tokens back, detokenizing) decides GPU
throughput. This drives `LLMEngine.step()` with a tiny random Llama (2 layers, hidden 64, SmolLM2's
tokenizer and 49,152-token vocabulary, so device time is small and vocabulary-sized host work shows) and
splits each decode step's wall time, by timing the engine's own phases in place:

- schedule: `Scheduler.schedule()`
- build: `build_step_batch` (numpy inputs for the bucket, sampling rows, bitmasks)
- dispatch: the compiled step called until it returns (flattening the arguments, launching)
- device: waiting for the sampled tokens (`to_host`), the device's share
- frontend: `OutputProcessor.process` (detokenizing, stop strings, `RequestOutput`s; DELTA outputs, as
  the server asks for, unless `--output-kind` says otherwise)
- rest: everything else in `step()`: the runner's bookkeeping, `Scheduler.update`, the core's outputs

"host" is the total minus the wait for the device, taken step by step before the median (so the device's
jitter stays out of it). "core host" is what stays on the engine core's loop when it runs in its own
process (`--engine-process`): host minus frontend, plus pickling the step's updates for the pipe
("pickle", timed on the side, not part of the step here).

With async scheduling (`--modes async`) the host's work for step N + 1 runs while the device computes
step N, so the wait shrinks by what overlaps; on a CPU the "device" is the same two cores, so the overlap
is partial there and whole on a GPU.

    python benchmarks/host_loop.py --seqs 64 256 --modes sync async --json docs/host-loop-cpu.json

Like `jaxserve serve`, it runs under tcmalloc when one is found (`jaxserve.allocator`);
JAXSERVE_ALLOCATOR=glibc measures glibc's malloc.
"""

import argparse
import json
import pickle
import time
from collections import defaultdict
from pathlib import Path

import numpy as np


def tiny_engine(max_num_seqs: int, async_scheduling: bool = False, vocab_size: int = 49152,
                prefix_caching: bool = False):
    import jax
    import jax.numpy as jnp
    from transformers import LlamaConfig

    from jaxserve.config import EngineConfig
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.models.gguf_cache import converted_dir
    from jaxserve.models.loader import LoadedModel, ModelSource, build_abstract_model, bundled_model_path
    from jaxserve.models.tokenizer import load_tokenizer
    from jaxserve.ops.attention import AttentionConfig

    hf_config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1,
                            eos_token_id=2)
    abstract = build_abstract_model(hf_config, jnp.float32, AttentionConfig("reference"))
    rng = np.random.default_rng(0)
    state = jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape, np.float32) * 0.3), abstract.state)
    gguf = bundled_model_path()
    model = LoadedModel(
        name="tiny", source=ModelSource(gguf.parent, None, "tiny"), hf_config=hf_config, cfg=abstract.cfg,
        spec=abstract.spec, graphdef=abstract.graphdef, state=state,
        tokenizer=load_tokenizer(converted_dir(gguf)), eos_token_ids=(2,), max_position_embeddings=512,
        dtype=jnp.float32, weight_dtype=jnp.float32)
    config = EngineConfig.from_preset(
        None, max_num_seqs=max_num_seqs, max_num_batched_tokens=512, token_buckets=[512],
        request_buckets=[max_num_seqs], num_kv_pages=max_num_seqs * 8 + 8, compilation_cache_dir="",
        enable_prefix_caching=prefix_caching, async_scheduling=async_scheduling)
    return LLMEngine(config, model=model)


def measure(num_seqs: int, decode_steps: int, mode: str, vocab_size: int = 49152, prefix_caching: bool = False,
            output_kind: str = "delta") -> dict:
    from jaxserve import RequestOutputKind, SamplingParams
    from jaxserve.engine.core_process import step_message
    from jaxserve.runner import model_runner

    engine = tiny_engine(num_seqs, async_scheduling=mode == "async", vocab_size=vocab_size,
                         prefix_caching=prefix_caching)
    runner = engine.runner
    phases: dict[str, float] = defaultdict(float)

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                phases[name] += time.perf_counter() - start
        return wrapper

    engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)
    model_runner.build_step_batch = timed("build", model_runner.build_step_batch)
    model_runner.to_host = timed("device", model_runner.to_host)
    runner._compiled = {bucket: timed("dispatch", compiled) for bucket, compiled in runner._compiled.items()}
    runner._compiled_samplers = {rows: timed("dispatch", sampler)  # CPUs: the step's second program
                                 for rows, sampler in runner._compiled_samplers.items()}
    engine.outputs.process = timed("frontend", engine.outputs.process)
    core_step = engine.core.step

    def core_step_and_pickle():
        updates = core_step()
        start = time.perf_counter()
        pickle.dumps(step_message(updates, engine.core.stats()))  # what the core process sends
        pickled = time.perf_counter() - start
        phases["pickle"] += pickled
        phases["untimed"] += pickled
        return updates

    engine._core.step = core_step_and_pickle

    params = SamplingParams(max_tokens=decode_steps + 16, temperature=0.0, ignore_eos=True,  # none ends early
                            output_kind=RequestOutputKind(output_kind))
    for i in range(num_seqs):
        engine.add_request(str(i), list(range(100 + i, 116 + i)), params)  # 16-token prompts
    for _ in range(1000):  # through the prefills, to the first step that decodes every sequence
        engine.step()
        last = runner.last_step
        if last is not None and last.bucket.decode_only and last.num_reqs == num_seqs:
            break
    rows = []
    for _ in range(decode_steps):
        phases.clear()
        start = time.perf_counter()
        engine.step()
        total = time.perf_counter() - start
        last = runner.last_step
        assert last.bucket.decode_only and last.num_reqs == num_seqs, (last, num_seqs)
        total -= phases.pop("untimed", 0.0)
        known = sum(v for k, v in phases.items() if k != "pickle")
        host = total - phases.get("device", 0.0)
        core_host = host - phases.get("frontend", 0.0) + phases.get("pickle", 0.0)
        rows.append({**{k: v * 1e3 for k, v in phases.items()}, "rest": (total - known) * 1e3,
                     "host": host * 1e3, "core host": core_host * 1e3, "total": total * 1e3})
    # Medians per column; host and core host are each step's own (the device's jitter stays out of them).
    median = {key: float(np.median([r.get(key, 0.0) for r in rows])) for key in rows[0]}
    engine.shutdown()
    from jaxserve.allocator import loaded_allocator

    return {"seqs": num_seqs, "mode": mode, "vocab_size": vocab_size, "prefix_caching": prefix_caching,
            "output_kind": output_kind,
            "allocator": loaded_allocator(),
            "decode_steps": decode_steps,
            "median_ms": {k: round(v, 3) for k, v in median.items()}}


def main() -> None:
    from jaxserve.allocator import loaded_allocator, preload_tcmalloc

    preload_tcmalloc()  # re-executes this script once, as the CLI does
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=50, help="decode steps measured per level")
    parser.add_argument("--modes", nargs="+", choices=["sync", "async"], default=["sync", "async"])
    parser.add_argument("--vocab-size", type=int, default=49152,
                        help="the tiny model's vocabulary (SmolLM2's by default; its tokenizer reads any ids below it)")
    parser.add_argument("--enable-prefix-caching", action="store_true",
                        help="as `serve` does by default (off here by default, as in the earlier tables)")
    parser.add_argument("--output-kind", choices=["delta", "cumulative", "final_only"], default="delta",
                        help="what the frontend builds each step (the server asks for deltas)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = [measure(n, args.steps, mode, args.vocab_size, args.enable_prefix_caching, args.output_kind)
               for n in args.seqs for mode in args.modes]
    print(f"allocator: {loaded_allocator()}")
    keys = ["schedule", "build", "dispatch", "device", "frontend", "rest", "host", "pickle", "core host", "total"]
    print("| running seqs | loop | " + " | ".join(f"{k} ms" for k in keys) + " |")
    print("|---" * (len(keys) + 2) + "|")
    for result in results:
        m = result["median_ms"]
        print(f"| {result['seqs']} | {result['mode']} | " + " | ".join(f"{m.get(k, 0.0):.2f}" for k in keys) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
