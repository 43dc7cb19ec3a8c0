"""Tensor parallelism in a subprocess with several CPU devices: generate at each TP size and compare with TP=1
(tests/test_parallel.py, tests/models/test_checkpoint.py).

The test process has one CPU device, and jax fixes the device count when its backend starts, so the checks
run in a worker process started with `--xla_force_host_platform_device_count=4`. One worker serves a test
module's checks in turn (`TPWorker`, the `tp_worker` fixture): each check paid about 4 s of Python and jax
start-up when it had a process of its own. Between checks the worker drops jax's caches, so each check
compiles, or loads from the persistent cache, what it runs, as in a process of its own.
"""

import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path

import numpy as np

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 5, 8,"]
NUM_DEVICES = 4
CHECK_TIMEOUT_S = 1200


def _check(spec: dict) -> list[dict]:
    """In the worker: generate greedily at each TP size; one result per size."""
    import jax

    from jaxserve import LLM

    assert len(jax.devices()) >= max(spec["tp_sizes"]), jax.devices()
    # The largest TP size loads first, from an empty jaxserve cache (a GGUF converts with its own heads).
    os.environ["JAXSERVE_CACHE_DIR"] = spec["cache_dir"]
    results = []
    for tp in spec["tp_sizes"]:
        rows = 4 if spec.get("speculative") is None else 12  # a verification's rows: the drafts' too
        llm = LLM(model=spec["model"], dtype="float32", weight_dtype=spec["weight_dtype"], tensor_parallel_size=tp,
                  max_num_seqs=rows,
                  # One bucket of each kind: the three prompts prefill in one step and decode together.
                  max_num_batched_tokens=32, token_buckets=[32], request_buckets=[rows], num_kv_pages=64,
                  attention_impl=spec["attention_impl"], enable_prefix_caching=False,
                  enable_expert_parallel=spec["expert_parallel"], quantization=spec["quantization"],
                  enable_lora=spec["lora"] is not None, speculative_config=spec.get("speculative"))
        try:
            results.append(_embed(llm, tp, spec) if spec.get("embed") else _generate(llm, tp, spec))
        finally:
            llm.engine.shutdown()
    return results


def _generate(llm, tp: int, spec: dict) -> dict:
    """What the TP=`tp` engine placed where, and the greedy tokens and top logprobs it gives."""
    import jax

    from jaxserve import LoRARequest, SamplingParams
    from tests.helpers import count_compilations

    # Top logprobs, but not where drafts run: a step verifies no drafts of a request that asks for them.
    logprobs = 5 if spec.get("speculative") is None else None
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, logprobs=logprobs, ignore_eos=True)
    lora = LoRARequest("adapter", 1, spec["lora"]) if spec["lora"] is not None else None
    if lora is not None:  # loaded before counting compiles: a first load compiles its slot write
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1), use_tqdm=False, lora_request=lora)
    runner = llm.engine.runner
    q_proj = _first_attention_weight(runner.model.state)
    placed = {str(s.device_set) for s in jax.tree.leaves(jax.tree.map(lambda x: x.sharding, runner.kv_caches))}
    scheduler = llm.engine.scheduler
    proposals: list[list[int]] = []  # each round's drafts, request by request
    if scheduler.proposer is not None:  # every draft run: steps cost alike to the policy, proposals nothing
        policy = scheduler.draft_policy
        policy.costs = dict.fromkeys(policy.row_buckets, 1.0)
        policy.observe_step = lambda *timed: None
        policy.observe_proposal = lambda num_requests, seconds: None
        propose_batch = scheduler.proposer.propose_batch

        def recording(running, max_drafts):
            drafts = propose_batch(running, max_drafts)
            proposals.extend(list(map(int, d)) for d in drafts)
            return drafts

        scheduler.proposer.propose_batch = recording
    with count_compilations() as compiles:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=lora)
    draft_runner = llm.engine.core.draft_runner
    draft_q_proj = _first_attention_weight(draft_runner.model.state) if draft_runner is not None else None
    return {
        "drafts": [scheduler.speculation.num_draft_tokens, scheduler.speculation.num_accepted_tokens],
        "proposals": proposals,
        "draft_q_proj_shards": [] if draft_q_proj is None else sorted(
            (str(shard.device), list(shard.data.shape)) for shard in draft_q_proj.addressable_shards),
        "draft_kv_devices": sorted({str(s.device_set) for s in jax.tree.leaves(
            jax.tree.map(lambda x: x.sharding, draft_runner.kv_caches))}) if draft_runner is not None else [],
        "tp": tp,
        "compiles_after_warmup": len(compiles),
        "kv_devices": sorted(placed),
        "kv_shard_shape": list(runner.kv_caches[0][0].addressable_shards[0].data.shape),
        "last_kv_shard_shape": list(runner.kv_caches[-1][0].addressable_shards[0].data.shape),  # features, if kept
        "q_proj_shards": sorted((str(shard.device), list(shard.data.shape)) for shard in q_proj.addressable_shards),
        "q_proj_dtype": str(q_proj.dtype),
        "experts": _experts_placement(runner.model.state),
        "tokens": [o.outputs[0].token_ids for o in outputs],
        "top_logprobs": [[sorted(d.items()) for d in o.outputs[0].top_logprobs or ()] for o in outputs],
    }


def _embed(llm, tp: int, spec: dict) -> dict:
    """The TP=`tp` pooling engine's vectors for the texts `spec["embed"]`, and where its weights went."""
    from tests.helpers import count_compilations

    with count_compilations() as compiles:
        outputs = llm.embed(spec["embed"], use_tqdm=False)
    q_proj = _first_attention_weight(llm.engine.runner.model.state)
    return {"tp": tp, "compiles_after_warmup": len(compiles), "embeddings": [o.outputs.embedding for o in outputs],
            "q_proj_shards": sorted((str(shard.device), list(shard.data.shape)) for shard in q_proj.addressable_shards)}


def _serve() -> None:
    """The worker's loop: a check's spec per line on stdin; its results, or the traceback that ended it, as
    one line on stdout."""
    import gc

    import jax

    for line in sys.stdin:
        try:
            reply = {"results": _check(json.loads(line))}
        except BaseException:  # the test that sent the check reports it
            reply = {"error": traceback.format_exc()}
        jax.clear_caches()
        gc.collect()
        print("\nREPLY " + json.dumps(reply), flush=True)  # on a line of its own, whatever was printed before


class TPWorker:
    """The worker process, started on first use and again after one that died."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._replies: queue.Queue[str | None] = queue.Queue()
        self._stderr = Path(tempfile.mkdtemp(prefix="jaxserve-tp-worker-")) / "stderr.log"

    def _start(self) -> subprocess.Popen:
        xla_flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={NUM_DEVICES}"
        # CPU devices on any machine: a GPU machine's test process may have only one GPU.
        env = {**os.environ, "XLA_FLAGS": xla_flags.strip(), "JAX_PLATFORMS": "cpu"}
        root = Path(__file__).resolve().parents[1]
        with open(self._stderr, "w") as stderr:  # the worker's own descriptor stays open
            proc = subprocess.Popen([sys.executable, "-c", "from tests.parallel_helpers import _serve; _serve()"],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                    env=env, cwd=root)
        replies = self._replies = queue.Queue()

        def read() -> None:
            for line in proc.stdout:
                if line.startswith("REPLY "):
                    replies.put(line[6:])
            replies.put(None)  # the process ended

        threading.Thread(target=read, daemon=True).start()
        return proc

    def _stderr_tail(self) -> str:
        return self._stderr.read_text(errors="replace")[-4000:]

    def check(self, spec: dict) -> list[dict]:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = self._start()
        try:
            self._proc.stdin.write(json.dumps(spec) + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            self._proc.wait()
            raise AssertionError(f"the TP worker died ({self._proc.returncode}):\n{self._stderr_tail()}") from None
        try:
            line = self._replies.get(timeout=CHECK_TIMEOUT_S)
        except queue.Empty:
            self._proc.kill()
            self._proc.wait()
            self._proc = None  # the next check starts another
            raise AssertionError(
                f"the TP worker gave no answer in {CHECK_TIMEOUT_S} s:\n{self._stderr_tail()}") from None
        if line is None:
            self._proc.wait()
            raise AssertionError(f"the TP worker died ({self._proc.returncode}):\n{self._stderr_tail()}")
        reply = json.loads(line)
        assert "error" not in reply, f"{reply['error']}\n(the worker's stderr:)\n{self._stderr_tail()}"
        return reply["results"]

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        shutil.rmtree(self._stderr.parent, ignore_errors=True)


def _experts_placement(state) -> dict | None:
    """The first mixture layer's stacked down projection: its form, and each device's shard of its values and
    (FP8) scales; None for a model without experts."""
    from flax import nnx, traverse_util

    from jaxserve.models.quantization import Fp8Experts

    flat = traverse_util.flatten_dict(nnx.to_pure_dict(state))
    down = next((value for path, value in flat.items() if path[-1] == "experts_down"), None)
    if down is None:
        return None
    shards = lambda array: sorted((str(s.device), list(s.data.shape)) for s in array.addressable_shards)  # noqa: E731
    if not isinstance(down, Fp8Experts):
        return {"form": str(down.dtype), "values": shards(down)}
    return {"form": f"fp8, blocks of {down.block}", "values": shards(down.values), "scale": shards(down.scale)}


def _first_attention_weight(state):
    from flax import nnx

    pure = nnx.to_pure_dict(state)
    layers = pure.get("layers") or pure["h"]
    layer = layers[0]
    if "q_proj" in layer:  # an encoder's (models/bert.py)
        return layer["q_proj"]
    attention = layer.get("self_attn", {})
    weight = attention.get("q_proj", attention.get("q_b_proj")) if attention else layer["qkv"]  # DeepSeek V3: q_b
    return getattr(weight, "values", weight)  # an Fp8Weight's e4m3 values


def run_tp(worker: TPWorker, model: str | None, cache_dir: Path, tp_sizes=(4, 2, 1), max_tokens: int = 12,
           attention_impl: str = "reference", weight_dtype: str = "auto", expert_parallel: bool = False,
           quantization: str | None = None, lora: str | None = None, speculative: dict | None = None,
           embed: list[str] | None = None) -> dict:
    """Each TP size's results, keyed by the size; the largest loads first, from an empty jaxserve cache in
    `cache_dir` (a GGUF converts with its own heads). `embed`: texts a pooling engine embeds (`_embed`)."""
    spec = dict(model=model, tp_sizes=list(tp_sizes), max_tokens=max_tokens, cache_dir=str(cache_dir),
                attention_impl=attention_impl, weight_dtype=weight_dtype, expert_parallel=expert_parallel,
                quantization=quantization, lora=lora, speculative=speculative, embed=embed)
    return {r["tp"]: r for r in worker.check(spec)}


def assert_same_as_tp1(results: dict, atol: float = 2e-4) -> None:
    base = results[1]
    for tp, got in results.items():
        assert got["compiles_after_warmup"] == 0, f"TP={tp} compiled after warm-up"
        assert len(got["kv_devices"]) == 1 and got["kv_devices"][0].count("CpuDevice") == tp
        assert got["tokens"] == base["tokens"], f"TP={tp} greedy tokens differ from TP=1"
        for seq, seq_base in zip(got["top_logprobs"], base["top_logprobs"], strict=True):
            for step, step_base in zip(seq, seq_base, strict=True):
                ids, lps = zip(*step, strict=True)
                ids_base, lps_base = zip(*step_base, strict=True)
                assert ids == ids_base, f"TP={tp}: top tokens differ"
                np.testing.assert_allclose(lps, lps_base, atol=atol, rtol=0)


def assert_tracks_tp1(results: dict, atol: float = 2e-2) -> None:
    """bfloat16 weights under a float32 model: each TP size tracks TP=1's top logprobs within `atol`, and its
    greedy tokens may part from TP=1's only at a near tie. Not token for token: the matmuls' inputs are
    rounded to bfloat16, so a sum that differs in its last float32 bit (a split reduction) can move an
    input by one bfloat16 step (~0.4%)."""
    whole = results[1]
    for tp, split in results.items():
        assert split["compiles_after_warmup"] == 0, f"TP={tp} compiled after warm-up"
        for tokens, tokens_whole, tops, tops_whole in zip(split["tokens"], whole["tokens"], split["top_logprobs"],
                                                          whole["top_logprobs"], strict=True):
            parted = next((i for i, (a, b) in enumerate(zip(tokens, tokens_whole, strict=True)) if a != b), None)
            for step in range(len(tokens) if parted is None else parted):
                assert [t for t, _ in tops[step]] == [t for t, _ in tops_whole[step]], f"TP={tp} step {step}"
                np.testing.assert_allclose([lp for _, lp in tops[step]], [lp for _, lp in tops_whole[step]],
                                           atol=atol, rtol=0)
            if parted is not None:  # one device's two best tokens were within rounding of each other
                best = sorted((lp for _, lp in tops_whole[parted]), reverse=True)
                assert best[0] - best[1] < atol, (tp, parted, tops_whole[parted])
