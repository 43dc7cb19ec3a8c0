"""ModelRunner's KV budget on a GPU, with a GPU's memory statistics stood in: the pages are what
utilization x device memory leaves after the weights, the penalty tables and the step's temp memory, which
a cold start estimates from the step's shapes and checks with the largest buckets' real compiles
(runner/kv_sizing.py: here for the CPU, the path is the same), and the warm-up serves with the executables
that sizing compiled instead of compiling them again. The shared engine keeps its sampler inside the step,
as GPUs do (`step_fn.samples_apart`): the sizing's compiles then hold the sampler's temp memory."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from jaxserve.config import CacheConfig
from jaxserve.runner import model_runner
from jaxserve.runner.aot import temp_estimate
from jaxserve.runner.buckets import largest_buckets
from jaxserve.runner.kv_budget import ALLOCATOR_SLACK_BYTES
from jaxserve.runner.kv_sizing import TEMP_MARGIN_BYTES, with_margin
from jaxserve.runner.penalties import PenaltyTables
from jaxserve.runner.temp_records import SUBDIRECTORY, TempRecords
from tests.engine.helpers import make_engine, make_prompts, run_alone
from tests.helpers import startup_phases

GIB = 2**30


@pytest.fixture(scope="module")
def engine(llama_dir):
    """The tiny Llama on the tests' ladder, its step built as a GPU's, with the sampler inside; its steps
    compile as they first run (the tests size its budget, and run a few requests on it)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model_runner, "samples_apart", lambda platform: False)
        return make_engine(llama_dir, warmup=False)


def recording_compiles(runner, monkeypatch) -> list[tuple[int, dict | None, int]]:
    """(page count, options, peak temp bytes) of each of the sizing's compiles of the largest buckets."""
    calls = []
    original = runner._compile_largest

    def compile_largest(device, num_pages, options):
        compiled = original(device, num_pages, options)
        calls.append((num_pages, options, max(c.temp_bytes for c in compiled.values())))
        return compiled

    monkeypatch.setattr(runner, "_compile_largest", compile_largest)
    return calls


def test_the_pages_fill_what_the_utilization_leaves(engine, monkeypatch):
    runner = engine.runner
    # No record from an earlier run in the shared cache's directory: this sizing estimates (the records
    # are the next test's).
    monkeypatch.setattr(runner, "_temp_records", None)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")  # what `serve` sets for utilization 0.9
    device_memory = 80 * GIB
    stats = {"bytes_limit": int(device_memory * 0.9), "bytes_in_use": 3 * GIB}  # weights, as loaded
    calls = recording_compiles(runner, monkeypatch)
    page_bytes = 2**20

    num_pages, executables = runner._num_kv_pages(CacheConfig(gpu_memory_utilization=0.9), page_bytes, stats)

    ((final, options, real),) = calls  # the real compile alone: the estimate came from the step's shapes
    estimated = temp_estimate(runner.model.cfg, runner._abstract_weights, largest_buckets(runner.ladder.all_buckets()))
    assert final == num_pages and options is None
    assert set(executables) == set(largest_buckets(runner.ladder.all_buckets()))  # for the warm-up
    assert not runner._sized_executables  # this runner's own cache was sized by --num-kv-pages
    assert 0 < real <= with_margin(estimated)  # XLA's memory analysis of the largest buckets: within the budget
    penalties = PenaltyTables.num_bytes(runner.max_num_seqs, runner.model.cfg.vocab_size)
    pool = stats["bytes_limit"]  # JAX's pool is exactly the 90% the budget may use
    free = pool - 3 * GIB - penalties - with_margin(estimated) - ALLOCATOR_SLACK_BYTES
    assert abs(num_pages - free // page_bytes) <= 1  # float rounding of 80 GiB x 0.9 / 0.9
    assert runner._num_kv_pages(CacheConfig(num_kv_pages=7), page_bytes, stats) == (7, {})  # a count wins


def test_a_sized_runner_serves_the_sizing_s_executables_and_the_same_tokens(llama_dir, engine, monkeypatch):
    """An engine built through the GPU budget: its KV cache is what the stats leave, the warm-up takes the
    largest buckets' executables from the sizing rather than compiling them again, and greedy tokens
    match the engine with a fixed page count."""
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    # A pool with ~64 MiB left for the step's temp memory and the KV cache.
    pool = ALLOCATOR_SLACK_BYTES + TEMP_MARGIN_BYTES + 64 * 2**20
    monkeypatch.setattr(model_runner, "device_memory_stats", lambda device: {"bytes_limit": pool,
                                                                              "bytes_in_use": 0})
    sized = make_engine(llama_dir, num_kv_pages=None, gpu_memory_utilization=0.9, token_buckets=(64,),
                        request_buckets=(8,))
    runner = sized.runner
    assert runner.num_pages > 1000  # tiny pages: ~2 KiB each
    assert set(runner._sized_executables) == set(largest_buckets(runner.ladder.all_buckets()))
    for bucket, executable in runner._sized_executables.items():
        assert runner._compiled[bucket] is executable.compiled  # taken, not compiled again
    for prompt in make_prompts(3):
        assert run_alone(sized, prompt, 12) == run_alone(engine, prompt, 12)


def test_a_warm_start_sizes_from_the_earlier_start_s_record(engine, monkeypatch, tmp_path, caplog):
    """With a persistent cache's directory, the sizing records the temp memory it sized for and the real
    compile's; the next sizing of the same step reads it and gets the same page
    count (so the real compile is the earlier start's executable); a step of other shapes has another
    record; a record whose executables differ from the real compile's is dropped."""
    runner = engine.runner
    monkeypatch.setattr(runner, "_temp_records", TempRecords(tmp_path))
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    stats = {"bytes_limit": int(80 * GIB * 0.9), "bytes_in_use": 3 * GIB}
    calls = recording_compiles(runner, monkeypatch)
    page_bytes = 2**20

    def size() -> tuple[int, dict]:
        return runner._num_kv_pages(CacheConfig(gpu_memory_utilization=0.9), page_bytes, stats)

    phases = startup_phases()
    with caplog.at_level(logging.INFO, "jaxserve.runner.model_runner"):
        cold_pages, _ = size()
    assert len(calls) == 1  # real, sized from the step's shapes
    assert "temp memory from the step's shapes in 0.0s" in caplog.text
    assert phases["sizing_quick_s"].search(caplog.text) and phases["sizing_real_s"].search(caplog.text)
    caplog.clear()
    (record,) = (tmp_path / SUBDIRECTORY).iterdir()
    estimated = temp_estimate(runner.model.cfg, runner._abstract_weights, largest_buckets(runner.ladder.all_buckets()))
    assert json.loads(record.read_text()) == {"sized_for_bytes": estimated, "compiled_bytes": calls[0][2]}

    with caplog.at_level(logging.INFO, "jaxserve.runner.model_runner"):
        warm_pages, executables = size()
    assert warm_pages == cold_pages and calls[1:] == [(cold_pages, None, calls[0][2])]  # the real compile alone
    assert "temp memory from an earlier start's record in 0.0s" in caplog.text
    assert float(phases["sizing_quick_s"].search(caplog.text).group(1)) == 0
    assert set(executables) == set(largest_buckets(runner.ladder.all_buckets()))
    assert json.loads(record.read_text()) == {"sized_for_bytes": estimated, "compiled_bytes": calls[0][2]}

    # The recorded executables were other than these (a change the key missed): the record goes.
    record.write_text(json.dumps({"sized_for_bytes": estimated, "compiled_bytes": calls[0][2] + 1}))
    with caplog.at_level(logging.INFO, "jaxserve.runner.model_runner"):
        assert size()[0] == cold_pages
    assert "its record is dropped" in caplog.text and not record.exists()

    monkeypatch.setattr(runner, "max_num_seqs", runner.max_num_seqs + 1)  # another step: its own record
    size()
    assert [options for _, options, _ in calls[3:]] == [None]  # real, sized from its shapes
    assert len(list((tmp_path / SUBDIRECTORY).iterdir())) == 1
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_dump_to=/nonexistent")
    other_flags = runner._sizing_key(jax.devices()[0], runner.max_pages_per_req + 1)
    monkeypatch.setenv("JAXSERVE_API_KEY", "rotated")  # the environment beyond what shapes the step: ignored
    assert runner._sizing_key(jax.devices()[0], runner.max_pages_per_req + 1) == other_flags
    monkeypatch.delenv("XLA_FLAGS")
    assert runner._sizing_key(jax.devices()[0], runner.max_pages_per_req + 1) != other_flags


def test_no_records_no_key_and_a_key_that_fails_skips_them(engine, monkeypatch, tmp_path, caplog):
    """Sizing without records computes no key; a key that cannot be computed (a source file unreadable,
    say) costs the record, not the start."""
    runner = engine.runner
    monkeypatch.setattr(runner, "_temp_records", None)
    assert runner._sizing_key(jax.devices()[0], 9) is None
    monkeypatch.setattr(runner, "_temp_records", TempRecords(tmp_path))

    def unreadable() -> str:
        raise PermissionError("a source file")

    monkeypatch.setattr(model_runner, "source_digest", unreadable)
    assert runner._sizing_key(jax.devices()[0], 9) is None
    assert "its key could not be computed (a source file)" in caplog.text


_KEY_IN_ANOTHER_PROCESS = """
import sys, jax
from tests.helpers import startup_phases
from tests.engine.helpers import make_engine
runner = make_engine(sys.argv[1], warmup=False).runner
print(runner._sizing_key(jax.devices()[0], runner.max_pages_per_req + 1))
"""


def test_the_sizing_key_is_the_same_in_another_process(llama_dir, engine):
    """The record is found by the next start only if the key is computed the same there: no object
    addresses, no hash-seeded order in what it digests, no environment beyond what shapes the step."""
    runner = engine.runner
    here = runner._sizing_key(jax.devices()[0], runner.max_pages_per_req + 1)
    root = Path(__file__).resolve().parents[2]
    other = subprocess.run([sys.executable, "-c", _KEY_IN_ANOTHER_PROCESS, str(llama_dir)], capture_output=True,
                           text=True, cwd=root, timeout=300,
                           env={**os.environ, "PYTHONHASHSEED": "11", "JAXSERVE_API_KEY": "another"})
    assert other.returncode == 0, other.stderr[-2000:]
    assert other.stdout.strip().splitlines()[-1] == here
    assert runner._sizing_key(jax.devices()[0], runner.max_pages_per_req + 2) != here


def test_weights_still_loading_count_by_their_shapes(engine, monkeypatch):
    """While the weights load on a thread, the device holds part of them: the budget counts them whole, by
    their shapes, and gets the pages a start with them all in gets."""
    runner = engine.runner
    monkeypatch.setattr(runner, "_temp_records", None)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    limit, page_bytes = int(80 * GIB * 0.9), 2**20
    cache = CacheConfig(gpu_memory_utilization=0.9)
    loaded, _ = runner._num_kv_pages(cache, page_bytes, {"bytes_limit": limit, "bytes_in_use": 3 * GIB})
    loading, _ = runner._num_kv_pages(cache, page_bytes, {"bytes_limit": limit, "bytes_in_use": GIB // 2},
                                      loading_weights_bytes=3 * GIB)  # a sixth of them in so far
    assert loading == loaded


def test_a_start_loading_beside_the_sizing_gets_the_pages_of_one_that_loaded_first(llama_dir, monkeypatch):
    """The budget of a start whose weights load beside the sizing's compiles counts what the device held
    before the load plus the weights by their shapes: the page count of a start that loaded them first and
    read the device's bytes in use."""
    from jaxserve.models import loader

    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    pool, held_before = GIB, 3 * 2**20  # held_before: another model's, say
    in_use = {"bytes": held_before}
    monkeypatch.setattr(model_runner, "device_memory_stats",
                        lambda device: {"bytes_limit": pool, "bytes_in_use": in_use["bytes"]})
    monkeypatch.setattr(loader, "device_memory_stats", lambda device: {"bytes_in_use": held_before})
    options = dict(num_kv_pages=None, gpu_memory_utilization=0.9, token_buckets=(64,), request_buckets=(8,),
                   warmup=False)
    beside = make_engine(llama_dir, **options).runner
    model = loader.load_model(str(llama_dir), "float32")
    in_use["bytes"] = held_before + sum(x.nbytes for x in jax.tree.leaves(model.state))
    first = make_engine(llama_dir, model=model, **options).runner
    assert beside.num_pages == first.num_pages > 100
