"""Structured outputs: decode throughput with every request constrained to a JSON schema against the
same requests unconstrained, in one process, alternating; and grammar compile time per schema.

    .venv/bin/python benchmarks/structured_outputs.py --config cpu --concurrency 16 --output-len 128

Each wave submits C requests with random prompts and greedy sampling. Unconstrained requests ignore EOS
and produce exactly --output-len tokens; constrained ones follow a schema whose array may keep growing,
but some close it and finish early, which leaves the wave's last steps with fewer rows. So two figures:
output tokens per second of the whole wave, and of its full decode steps alone (every one of the C
requests gets a token), which is the cost of a step with C constrained rows against C free ones.
"""

import argparse
import json
import statistics
import time

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.structured_output import GrammarCompiler
from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams

LOG = {  # an open-ended array of records: the mask works on every token until max_tokens
    "type": "object",
    "properties": {"events": {"type": "array", "items": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0}, "level": {"enum": ["info", "warn", "error"]},
                       "message": {"type": "string", "maxLength": 60}},
        "required": ["id", "level", "message"], "additionalProperties": False}}},
    "required": ["events"], "additionalProperties": False,
}
SCHEMAS = {
    "log (open array of records)": LOG,
    "person (nested, enums, bounds, pattern)": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 130},
                       "address": {"type": "object",
                                   "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
                       "languages": {"type": "array", "items": {"enum": ["en", "fr", "de"]}}},
        "required": ["name", "age"]},
    "tool call, 2 functions (required)": {
        "type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"const": f"f{i}"}, "parameters": {
                "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}}},
             "required": ["name", "parameters"], "additionalProperties": False} for i in range(2)]}},
    "object, 100 properties": {"type": "object", "properties": {f"field_{i}": {"type": "number"} for i in range(100)}},
}


def wave(
    engine: LLMEngine, concurrency: int, input_len: int, output_len: int,
    structure: StructuredOutputsParams | None, seed: int,
) -> tuple[int, float, float]:
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=structure is None,
                            structured_outputs=structure)
    start = time.perf_counter()
    for i in range(concurrency):
        prompt = rng.integers(100, engine.vocab_size - 100, size=input_len).tolist()
        engine.add_request(f"w{seed}-{i}-{structure is None}", prompt, params)
    tokens, full_steps, full_seconds = 0, 0, 0.0
    while engine.has_unfinished_requests():
        step_start = time.perf_counter()
        outputs = engine.step()
        step_seconds = time.perf_counter() - step_start
        if len(outputs) == concurrency and all(len(o.outputs[0].token_ids) > 1 for o in outputs):
            full_steps, full_seconds = full_steps + 1, full_seconds + step_seconds  # a decode step of all C
        for output in outputs:
            assert output.error is None, output.error
            if output.finished:
                tokens += sum(len(c.token_ids) for c in output.outputs)
    full_rate = concurrency * full_steps / full_seconds if full_steps else float("nan")
    return tokens, time.perf_counter() - start, full_rate


def compile_times(engine: LLMEngine, repeats: int = 5) -> dict[str, float]:
    """Milliseconds to compile each schema on a fresh compiler (its tokenizer built beforehand), median."""
    result = {}
    for name, schema in SCHEMAS.items():
        times = []
        for _ in range(repeats):
            compiler = GrammarCompiler(engine.tokenizer, engine.vocab_size, engine.model.eos_token_ids)
            compiler.tokenizer  # noqa: B018  built once per process in the server, not per schema
            start = time.perf_counter()
            compiler.compile(StructuredOutputsParams(json=schema))
            times.append(1000 * (time.perf_counter() - start))
        result[name] = statistics.median(times)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    # Synchronous for both waves: a grammar's steps each wait for the last token anyway, so the ratio is
    # the grammar's own cost, not that plus the overlap async scheduling gives the unconstrained wave.
    engine = LLMEngine(EngineConfig.from_preset(args.config, dtype=args.dtype, max_model_len=1024,
                                                async_scheduling=False))
    structure = StructuredOutputsParams(json=LOG)
    engine.grammars.compile(structure)  # the tokenizer and this grammar, outside the timed waves
    wave(engine, args.concurrency, args.input_len, 8, None, seed=999)  # first runs of the buckets
    rates: dict[str, list[float]] = {"unconstrained": [], "json schema": []}
    full_rates: dict[str, list[float]] = {"unconstrained": [], "json schema": []}
    for r in range(args.rounds):
        for name, s in (("unconstrained", None), ("json schema", structure)):
            tokens, seconds, full = wave(engine, args.concurrency, args.input_len, args.output_len, s, seed=r + 1)
            rates[name].append(tokens / seconds)
            full_rates[name].append(full)
            print(f"round {r} {name:>13}: {tokens} tokens in {seconds:.1f}s = {tokens / seconds:.1f} tok/s; "
                  f"full decode steps {full:.1f} tok/s", flush=True)
    free, constrained = statistics.median(rates["unconstrained"]), statistics.median(rates["json schema"])
    full_free, full_constrained = (statistics.median(full_rates[k]) for k in ("unconstrained", "json schema"))
    print(f"median output tok/s: unconstrained {free:.1f}, json schema {constrained:.1f}, "
          f"ratio {constrained / free:.3f}; full decode steps {full_free:.1f} vs {full_constrained:.1f}, "
          f"ratio {full_constrained / full_free:.3f}")
    compiles = compile_times(engine)
    for name, ms in compiles.items():
        print(f"compile {name}: {ms:.1f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "tok_per_s": rates, "ratio": constrained / free,
                       "full_step_tok_per_s": full_rates, "full_step_ratio": full_constrained / full_free,
                       "compile_ms": compiles},
                      f, indent=2)


if __name__ == "__main__":
    main()
