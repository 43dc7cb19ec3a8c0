"""A background warm-up: the engine is ready after one bucket, steps run in the smallest compiled bucket
that holds them meanwhile, every token is what a fully warmed engine produces, and once every bucket is
in nothing compiles again."""

import re

import jax

from tests.engine.helpers import greedy, make_engine, make_prompts
from tests.helpers import count_compilations, startup_phases


def run_all(engine, prompts, max_tokens=6) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy(max_tokens))
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output.outputs[0].token_ids
    return done


def test_ready_after_one_bucket_and_the_same_tokens_while_the_rest_compile(llama_dir):
    prompts = make_prompts()
    want = run_all(make_engine(llama_dir), prompts)
    jax.clear_caches()  # the next engine compiles as in a new process (not the first one's programs, `_shared`)

    engine = make_engine(llama_dir, warmup_mode="background")
    runner = engine.runner
    largest = max(b for b in runner.ladder.all_buckets() if not b.decode_only)
    runner.stop_warmup()  # freeze the table, so fallbacks are certain to serve
    runner.wait_for_warmup()  # the compiles under way finish; the queued ones were dropped
    compiled = set(runner._compiled)
    assert largest in compiled
    missing = set(runner.ladder.all_buckets()) - compiled
    assert missing, "stopped right after start: most buckets were still to compile"
    for wanted in missing:
        used = runner._runnable_bucket(wanted)
        assert used in compiled and used.num_tokens >= wanted.num_tokens and used.num_reqs >= wanted.num_reqs
        assert wanted.decode_only or not used.decode_only  # a mixed step never lands in a decode bucket
    assert run_all(engine, prompts) == want


def test_k_step_decodes_wait_for_their_executables(llama_dir, monkeypatch):
    """`--num-scheduler-steps 4` under a background warm-up, which compiles the k-step variants last: until
    they are in, decodes run one step at a time (a k-step decode would compile its variant in the step, on
    the engine's thread), with the same tokens; once they are in, k-step decodes run and nothing compiles."""
    import threading

    from jaxserve.runner.model_runner import ModelRunner

    prompts = make_prompts()
    want = run_all(make_engine(llama_dir), prompts, max_tokens=12)  # single steps, every bucket compiled
    release = threading.Event()
    compile_one = ModelRunner._compile_one

    def held(runner, job, slots):
        if job[1].multi_step:  # the k-step variants wait for the test
            release.wait(300)
        return compile_one(runner, job, slots)

    monkeypatch.setattr(ModelRunner, "_compile_one", held)
    engine = make_engine(llama_dir, warmup_mode="background", num_scheduler_steps=4)
    runner = engine.runner
    try:
        assert runner.decode_steps_ready() == 1
        assert run_all(engine, prompts, max_tokens=12) == want
        assert runner.num_multi_steps == 0, "a k-step decode ran before its executable was compiled"
    finally:
        release.set()
    runner.wait_for_warmup()
    assert runner.decode_steps_ready() == 4
    with count_compilations() as compiles:
        assert run_all(engine, prompts, max_tokens=12) == want
    assert compiles == [] and runner.num_multi_steps > 0
    engine.shutdown()


def test_once_every_bucket_is_in_nothing_compiles(llama_dir):
    engine = make_engine(llama_dir, warmup_mode="background")
    engine.runner.wait_for_warmup()
    assert set(engine.runner._compiled) == set(engine.runner.ladder.all_buckets())
    with count_compilations() as compiles:
        assert run_all(engine, make_prompts()[:4])
    assert compiles == []
    engine.shutdown()


def test_auto_is_ready_after_one_bucket_cold_or_warm_and_a_warm_start_loads_the_rest(llama_dir, tmp_path):
    """`--warmup auto` (the default) on one host: ready once the largest bucket is in, the rest compiling
    (a cold cache) or loading (a warm one) while it serves; both generate the same tokens and end with
    every bucket in. A `full` warm-up then loads every bucket from what the background one wrote (the
    cache's keys do not depend on whether a step ran before a compile). In a subprocess: the persistent
    cache is process-wide. Each start after the first clears what JAX holds in memory, as a new process
    starts without it (else the engines share their programs, `step_fn._shared`, and load nothing)."""
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    script = textwrap.dedent(f"""
        import logging, sys
        import jax
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s: %(message)s")
        from tests.engine.helpers import make_engine, make_prompts
        from tests.runner.test_background_warmup import run_all
        for start, mode in (("cold", "auto"), ("warm", "auto"), ("full", "full")):
            print("start", start)
            engine = make_engine({str(llama_dir)!r}, compilation_cache_dir={str(tmp_path / "xla")!r},
                                 warmup_mode=mode, token_buckets=(64,), request_buckets=(1, 8))
            print("tokens", start, run_all(engine, make_prompts()))
            engine.runner.wait_for_warmup()
            print("compiled", start, len(engine.runner._compiled), len(engine.runner.ladder.all_buckets()))
            engine.shutdown()
            jax.clear_caches()
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parents[2], env=dict(os.environ),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    _, cold, warm, full = re.split(r"^start \w+$", result.stdout, flags=re.MULTILINE)
    printed = {tuple(line.split(" ", 2)[:2]): line.split(" ", 2)[2] for line in result.stdout.splitlines()
               if line.startswith(("tokens ", "compiled "))}  # (what, start) -> the rest of the line
    assert printed["tokens", "cold"] == printed["tokens", "warm"] == printed["tokens", "full"]
    for start in ("cold", "warm", "full"):
        compiled, total = printed["compiled", start].split()
        assert compiled == total
    assert "warm-up: 1 of " in cold and "(not cached); compiling the rest in the background" in cold
    assert " 0 from the persistent cache" in cold
    # a warm start still traces and lowers its steps: the persistent cache's key is the lowered module (read
    # as benchmarks/startup.py reads it)
    phases = startup_phases()
    for start in (cold, warm):
        assert float(phases["trace_s"].search(start).group(1)) > 0
        assert float(phases["lower_s"].search(start).group(1)) > 0
    assert "warm-up: 1 of " in warm and "(from the persistent cache); compiling the rest in the background" in warm
    for later in (warm, full):
        loads = re.findall(r"compiled (\d+) buckets on \d+ threads, (\d+) from the persistent cache", later)
        assert loads and all(int(compiled) == int(hits) > 0 for compiled, hits in loads), loads


def test_a_cpu_kv_cache_is_zeroed_on_a_thread_beside_the_first_compile(llama_dir, monkeypatch):
    """On a CPU, zeroing the KV cache is the first touch of every page: it runs on a thread of its own, so the
    warm-up's first compile starts while it is under way, and the first step waits for it. The cache is then
    zeros in the steps' shapes and dtype, and the engine's greedy tokens are a fully synchronous start's."""
    import threading

    from jaxserve.runner import model_runner
    from jaxserve.runner.model_runner import ModelRunner

    assert jax.default_backend() == "cpu"  # the suite's backend for this model (tests/conftest.py)
    prompts = make_prompts()
    want = run_all(make_engine(llama_dir), prompts)
    zeroing_threads, compiling = [], threading.Event()
    release = threading.Event()
    zeroed, compile_one = model_runner._zeroed_kv_caches, ModelRunner._compile_one

    def held_zeroing(abstract):
        zeroing_threads.append(threading.current_thread())
        assert release.wait(60), "the first compile never started while the cache was being zeroed"
        return zeroed(abstract)

    def noted_compile(runner, job, slots):
        compiling.set()
        release.set()  # a compile under way while the zeroing waits: the two overlap
        return compile_one(runner, job, slots)

    monkeypatch.setattr(model_runner, "_zeroed_kv_caches", held_zeroing)
    monkeypatch.setattr(ModelRunner, "_compile_one", noted_compile)
    engine = make_engine(llama_dir, num_kv_pages=200)  # another page count: not the first engine's programs
    assert compiling.is_set()
    assert [t.name for t in zeroing_threads] == ["jaxserve-kv-cache"]
    runner = engine.runner
    abstract = model_runner.abstract_kv_caches(runner._step_shapes, jax.devices()[0], runner.mesh)
    caches = runner.kv_caches
    assert [[(p.shape, p.dtype) for p in layer] for layer in caches] == \
        [[(p.shape, p.dtype) for p in layer] for layer in abstract]
    assert run_all(engine, prompts) == want
