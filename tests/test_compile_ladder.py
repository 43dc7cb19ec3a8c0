"""The GPU proof: the whole step compiles for an H100 on this CPU-only machine (XLA's deviceless
compilation: XLA:GPU's passes, Triton for the Pallas kernels, ptxas), at buckets of configs/gpu.yaml.

Any XLA, Triton or ptxas error fails these tests; `test_an_oversized_kernel_block_is_rejected` shows that
such errors are caught here and not only on a user's GPU. Nothing runs, so numerics and speed are not
checked (tests/ops check the kernels' numerics in interpret mode).
"""

import functools
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from jaxserve.compile_ladder import compile_ladder, format_report
from jaxserve.config import SpeculativeConfig
from jaxserve.device import deviceless_device, target_facts
from jaxserve.ops import paged_attention_pallas
from jaxserve.parallel import on_one_device
from jaxserve.runner.buckets import Bucket, BucketLadder
from jaxserve.runner.kv_budget import ALLOCATOR_SLACK_BYTES
from tests.eagle import write_eagle3

GPU_LADDER = BucketLadder(
    (256, 512, 1024, 2048), (1, 16, 64, 256), max_num_batched_tokens=2048, max_num_seqs=256,
).all_buckets()  # configs/gpu.yaml's; test_the_gpu_ladder_is_the_preset keeps them in step


def test_the_gpu_ladder_is_the_preset():
    from jaxserve.config import EngineConfig

    config = EngineConfig.from_preset("gpu")
    ladder = BucketLadder(config.buckets.token_buckets, config.buckets.request_buckets,
                          config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs)
    assert ladder.all_buckets() == GPU_LADDER


def _check_report(report, buckets: list[Bucket], launches_read: bool = True, budgeted: bool = True) -> None:
    assert [Bucket(b.num_tokens, b.num_reqs, b.decode_only) for b in report.buckets] == buckets
    assert report.attention == "pallas"  # what `auto` picks on a real H100
    assert report.dtype == "bfloat16"
    assert all(b.temp_bytes > 0 and b.compile_seconds > 0 for b in report.buckets)
    # jax's tracing and lowering: part of the compile time (the CPU reference's for XLA's cost left out)
    assert report.trace_seconds > 0 and report.lower_seconds > 0
    assert report.trace_seconds + report.lower_seconds < report.compile_seconds
    assert all(b.predicted_seconds > 0 and b.bound in ("compute", "memory") for b in report.buckets)
    # What each step launches, from XLA's thunks: most kernels recorded in command buffers, a few host ops.
    for b in report.buckets if launches_read else ():
        launches = b.launches
        assert launches.num_kernels > 100 and launches.num_graphs >= 1 and 0 < launches.graph_share <= 1
        assert launches.host_ops.get("kCommandBuffer", 0) >= 1 and launches.num_host_ops < launches.num_kernels
        assert launches.num_arguments > 100  # the weights are passed as leaves: each its own argument
    if not budgeted:  # the page count was given: no budget, and no compiles for one
        assert report.kv_budget is None and report.num_kv_pages_given
        return
    # The KV budget is sized as a cold serve sizes it (runner/kv_sizing.py): the step's temp memory
    # estimated from its shapes plus the margin, which covers every bucket's compiled temp memory.
    budget = report.kv_budget
    assert budget.device_memory_bytes == target_facts("h100").memory_bytes and budget.utilization == 0.9
    assert budget.weights_bytes == report.weights_bytes and budget.state_bytes == report.state_bytes
    assert budget.bytes_per_page == report.bytes_per_page
    want = (int(budget.device_memory_bytes * 0.9) - report.weights_bytes - report.state_bytes
            - budget.peak_temp_bytes - ALLOCATOR_SLACK_BYTES)
    assert report.kv_budget_bytes == want
    assert report.max_temp_bytes <= budget.peak_temp_bytes
    assert report.num_kv_pages == want // budget.bytes_per_page > 0


@pytest.mark.slow
def test_gpt2_compiles_for_h100_through_the_cli(tmp_path):
    """`jaxserve compile` end to end on a small ladder: the report, its JSON and the KV budget line. Every
    bucket of the gpu preset compiled on a real H100 and H200 (`scripts/gpu_check.sh`); the widest ones
    deviceless in the Llama-3-8B and SmolLM2 tests; here a small ladder keeps the suite's time."""
    ladder = tmp_path / "ladder.yaml"
    ladder.write_text("buckets: {token_buckets: [256], request_buckets: [16]}\n"
                      "scheduler: {max_num_seqs: 16, max_num_batched_tokens: 256}\ncache: {page_size: 16}\n")
    out = tmp_path / "gpt2.json"
    cache = tmp_path / "xla"  # deviceless executables cannot be read back: none is written
    run = subprocess.run(
        [sys.executable, "-m", "jaxserve", "compile", "--model", "gpt2", "--target", "h100", "--config", str(ladder),
         "--dtype", "bfloat16", "--no-xla-cost", "--no-variants", "--jobs", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=1500, env={**os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache)},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert not cache.exists() or not any(cache.iterdir())
    assert "KV budget at --gpu-memory-utilization 0.9" in run.stdout
    report = json.loads(out.read_text())
    buckets = [Bucket(b["num_tokens"], b["num_reqs"], b["decode_only"]) for b in report["buckets"]]
    assert buckets == [Bucket(16, 16, decode_only=True), Bucket(256, 16)]
    assert report["attention"] == "pallas" and report["device"] == "NVIDIA H100 80GB HBM3"
    # GPT-2: 12 layers of 12 KV heads of 64 dims, K and V in bfloat16, 16 tokens a page
    assert report["bytes_per_page"] == report["kv_budget"]["bytes_per_page"] == 2 * 12 * 12 * 16 * 64 * 2
    assert all(b["temp_bytes"] > 0 and b["predicted_seconds"] > 0 for b in report["buckets"])


@pytest.mark.slow
def test_smollm2_compiles_for_h100_at_the_widest_buckets():
    """SmolLM2's odd head counts (9 query heads, 3 KV heads of 64) at the widest decode and mixed buckets
    (the GPT-2 compile takes the narrowest). Launches are read and the KV budget sized in the GPT-2 and
    Llama-3-8B compiles: here the page count is given (180,000 pages of SmolLM2, 66 GB, within an H100's
    budget), which spares the sizing's two compiles."""
    buckets = [Bucket(256, 256, decode_only=True), GPU_LADDER[-1]]
    assert all(b in GPU_LADDER for b in buckets)
    report = compile_ladder("smollm2-135m", target="h100", preset="gpu", dtype="bfloat16", xla_cost=False,
                            variants=False, buckets=buckets, read_launches=False, num_kv_pages=180_000)
    _check_report(report, sorted(buckets), launches_read=False, budgeted=False)
    assert all(b.launches is None for b in report.buckets)


@pytest.mark.slow
def test_llama_3_8b_compiles_for_h100_at_the_narrowest_and_widest_buckets():
    """The narrowest bucket and the two largest, whose temp memory a cold start's KV sizing estimates from
    the step's shapes (runner/kv_sizing.py, with a margin): the estimate alone covers what XLA:GPU's memory
    analysis gives them, the MLP rows of Llama-3-8B's 2,048 tokens a fifth above the sampler's."""
    buckets = [GPU_LADDER[0], Bucket(256, 256, decode_only=True), GPU_LADDER[-1]]
    assert buckets[0] == Bucket(1, 1, decode_only=True) and buckets[-1] == Bucket(2048, 256)
    assert all(b in GPU_LADDER for b in buckets)
    report = compile_ladder("llama-3-8b", target="h100", preset="gpu", dtype="bfloat16", xla_cost=False,
                            variants=False, buckets=buckets)
    _check_report(report, buckets)
    assert report.weights_bytes == 8_030_261_248 * 2
    # 256 sequences of 8192 tokens do not fit next to 16 GB of weights; tens of thousands of pages do.
    assert 20_000 < report.num_kv_pages < 256 * 8192 // 16
    assert report.estimated_temp_bytes >= report.max_temp_bytes > 0
    assert report.estimated_temp_bytes < 1.5 * report.max_temp_bytes  # and costs at most a few hundred MiB


@pytest.mark.slow
def test_deepseek_v2_lite_compiles_for_h100_over_its_latent_cache():
    """DeepSeek's latent attention at a decode and a mixed bucket: its 576-dim heads (one KV head of the latent
    and the RoPE key) in the Triton kernels' wide-head blocks, which fit an H100's shared memory where the
    defaults asked for 297 KB (tests/ops/test_attention.py checks their numbers), its experts on the Mosaic
    GPU grouped matmul; a page is each layer's keys alone (its values are its keys) of 16 tokens x 576 values.
    Its first two layers (a dense one and one of experts): the kernels are each layer's same ones."""
    buckets = [Bucket(16, 16, decode_only=True), Bucket(256, 16)]
    report = compile_ladder("deepseek-v2-lite", target="h100", preset="gpu", dtype="bfloat16", xla_cost=False,
                            variants=False, buckets=buckets, read_launches=False, num_kv_pages=20_000,
                            hf_overrides={"num_hidden_layers": 2})
    _check_report(report, buckets, launches_read=False, budgeted=False)
    assert report.bytes_per_page == 2 * 16 * 576 * 2  # 2 layers' K alone, bfloat16


@pytest.mark.slow
def test_gpt2_compiles_for_a100():
    """The A100 description (trimmed to what jaxlib 0.10's proto reads) works, and `auto` picks the kernels
    for compute capability 8.0 with its 108 SMs."""
    report = compile_ladder("gpt2", target="a100", preset="gpu", dtype="bfloat16", xla_cost=False,
                            variants=False, buckets=[Bucket(1, 1, decode_only=True)])
    assert report.device == "NVIDIA A100-SXM4-80GB" and report.attention == "pallas"
    assert report.kv_budget.device_memory_bytes == 85100068864 and report.num_kv_pages > 0


@pytest.mark.slow
def test_the_greedy_decode_variant_is_one_command_buffer_on_h100():
    """`--greedy-decodes`: the decode step without the sampler's control flow runs as one command buffer
    (one host operation, no predicate read by the host; the full sampler's conditionals are shown in the
    variants' test). No kernel of the one-row step writes an array of a projection weight's shape: XLA:GPU
    ran GPT-2's output and down projections at one row as a multiply that wrote the product whole, then a
    reduction (24 such kernels a step, before `layers.dense` padded one row to two)."""
    from jaxserve.compile_ladder import load_model_config
    from jaxserve.models.loader import build_abstract_model
    from jaxserve.ops.attention import resolve_attention
    from jaxserve.runner.aot import compile_bucket, step_shapes
    from jaxserve.runner.step_fn import make_step_fn

    _, hf_config = load_model_config("gpt2")
    abstract = build_abstract_model(hf_config, jnp.bfloat16, resolve_attention("auto", target_facts("h100")))
    shapes = step_shapes(abstract.cfg, jnp.dtype(jnp.bfloat16), 16, 4096, 64, 256)
    step = make_step_fn(abstract.graphdef, jax.tree.structure(abstract.state), 20, greedy=True)
    compiled = compile_bucket(step, abstract.state, shapes, Bucket(1, 1, decode_only=True),
                              deviceless_device("h100"), read_launches=True)
    launches = compiled.launches
    hlo = compiled.compiled.as_text()
    weights = {re.escape(f"bf16[{','.join(map(str, w.shape))}]") for w in jax.tree.leaves(abstract.state)
               if w.ndim >= 2 and w.size >= 768 * 768}
    assert weights and not re.findall(rf"= ({'|'.join(weights)})\S* fusion\(", hlo)
    assert launches.host_ops == {"kCommandBuffer": 1} and launches.host_syncs == 0
    assert launches.graph_share == 1.0 and launches.control_flow == {}


@pytest.mark.slow
def test_enforce_eager_compiles_the_step_without_command_buffers_for_h100():
    """`--enforce-eager` (vLLM's flag, which runs without CUDA graphs): the same decode step as the
    command-buffer tests above, with no command buffer at all; the host issues each of its kernels. The
    sampler's program and a CPU's steps have no such option to take (`step_compiler_options`)."""
    from jaxserve.runner.aot import step_compiler_options

    report = compile_ladder("gpt2", target="h100", preset="gpu", dtype="bfloat16", xla_cost=False, variants=False,
                            buckets=[Bucket(4, 4, decode_only=True)], num_kv_pages=4096, enforce_eager=True)
    (row,) = report.buckets
    launches = row.launches
    assert launches.num_graphs == 0 and launches.kernels_in_graphs == 0 and launches.graph_share == 0
    assert "kCommandBuffer" not in launches.host_ops and launches.num_kernels > 100
    assert launches.num_host_ops > 100, "the host issues the kernels one by one"
    assert step_compiler_options(True, "gpu") == {"xla_gpu_enable_command_buffer": ""}
    assert step_compiler_options(True, "cpu") == {} and step_compiler_options(False, "gpu") == {}


@pytest.mark.slow
def test_the_gpu_preset_s_decode_variants_are_compiled_as_serve_compiles_them():
    """`jaxserve compile` holds what serve compiles: each decode bucket plain, greedy, multi-step and
    multi-step greedy (the gpu preset turns both on); mixed buckets plain only.

    What each launches: the full sampler's conditionals read predicates on the host, which the greedy
    variant has none of. `--num-scheduler-steps 8`'s greedy steps are one loop of known trip count, whose
    body is one command buffer that the host issues 8 times without reading a predicate back."""
    report = compile_ladder("gpt2", target="h100", preset="gpu", dtype="bfloat16", xla_cost=False,
                            buckets=[Bucket(4, 4, decode_only=True), Bucket(128, 4)], num_kv_pages=4096,
                            max_num_seqs=512)  # serve's limit beyond the preset's ladder: the step's rows too
    assert report.kv_budget is None and report.num_kv_pages == 4096  # given: no budget, no compiles for it
    assert report.max_num_seqs == 512
    rows = {(b.num_tokens, b.decode_only, b.variant): b.launches for b in report.buckets}
    assert set(rows) == {(4, True, "plain"), (4, True, "greedy"), (4, True, "multi-step"),
                         (4, True, "multi-step greedy"), (128, False, "plain")}
    plain, greedy = rows[4, True, "plain"], rows[4, True, "greedy"]
    assert greedy.host_syncs == 0 and plain.host_syncs > 0 and plain.num_kernels > greedy.num_kernels
    multi = rows[4, True, "multi-step greedy"]
    assert multi.control_flow == {"kWhile": 1} and multi.counted_loops == 1 and multi.host_syncs == 0
    assert multi.host_ops["kCommandBuffer"] == 1 and multi.host_ops["kWhile"] == 1
    assert multi.num_host_ops <= 6 and multi.graph_share > 0.95
    assert rows[4, True, "multi-step"].host_syncs >= 1, "the full sampler's conditionals sync in each iteration"
    assert "multi-step greedy" in format_report(report)


@pytest.mark.slow
def test_a_classifier_compiles_the_pooling_step_serve_runs_for_h100(classifier_dir):
    """A classifier serves with --runner pooling (engine/core.py): `jaxserve compile` compiles that step, its
    head included, and none of the decode variants the gpu preset turns on for generation."""
    directory, _ = classifier_dir("qwen3")
    report = compile_ladder(str(directory), target="h100", preset="gpu", dtype="bfloat16", xla_cost=False,
                            buckets=[Bucket(4, 4, decode_only=True), Bucket(128, 4)], num_kv_pages=4096)
    assert {(b.num_tokens, b.variant) for b in report.buckets} == {(4, "plain"), (128, "plain")}


@pytest.mark.slow
def test_an_encoder_compiles_the_pooling_step_serve_runs_for_h100():
    """An encoder (the bundled all-MiniLM-L6-v2 shape) serves as engine/pooling_mode.py makes it: the pooling
    step alone, a context of its 512 positions (the gpu preset's 2,048-token steps take any prompt whole), and
    the pages of two steps' prompts (2 x (2,048 / 16 + 256 rows) + 1), not a memory budget."""
    report = compile_ladder("all-minilm-l6-v2", target="h100", preset="gpu", dtype="bfloat16", xla_cost=False,
                            buckets=[Bucket(4, 4, decode_only=True), Bucket(512, 4)])
    assert {(b.num_tokens, b.variant) for b in report.buckets} == {(4, "plain"), (512, "plain")}
    assert report.max_model_len == 512 and report.num_kv_pages == 769 and report.num_kv_pages_given


@pytest.mark.slow
def test_an_encoder_s_sentence_transformers_length_is_the_compiled_context(encoder_dir, tmp_path):
    """`jaxserve compile` reads a sentence-transformers encoder's max_seq_length as serve does
    (`pooling_mode.encoder_context`): the page tables are as wide as serve's."""
    import shutil

    from tests.encoders import save_sentence_transformers_pooling

    directory = tmp_path / "st"
    shutil.copytree(encoder_dir("bert")[0], directory)
    save_sentence_transformers_pooling(directory, "mean_tokens", max_seq_length=48)
    report = compile_ladder(str(directory), target=None, preset="cpu", dtype="float32", xla_cost=False,
                            buckets=[Bucket(64, 4)])
    assert report.max_model_len == 48


@pytest.mark.slow
def test_a_budgeted_kv_cache_compiles_the_step_a_small_one_does():
    """XLA:GPU's memory limit deviceless is 80% of the device's memory, which a KV cache budgeted at 90%
    exceeds; a real GPU's is its allocator pool. The deviceless compile now gets the pool's limit
    (`deviceless_devices`): before, rematerialization reworked the budgeted decode step towards a limit of
    zero (8 kernels more at 128,000 pages than at 8,192)."""
    buckets = [Bucket(1, 1, decode_only=True)]
    small, budgeted = (compile_ladder("gpt2", target="h100", preset="gpu", dtype="bfloat16", xla_cost=False,
                                      variants=False, buckets=buckets, num_kv_pages=pages).buckets[0].launches
                       for pages in (8192, 128_000))  # 128,000 pages of GPT-2: 70 GiB, the budget's
    assert budgeted.num_kernels == small.num_kernels and budgeted.host_ops == small.host_ops


def _tiny_llama_h100_step(tiny_model_dir, bucket: Bucket, num_top_logprobs: int,
                          max_drafts: int = 0) -> tuple[str, int]:
    """The tiny Llama's step for `bucket`, compiled for an H100 in bfloat16: its HLO and the vocabulary."""
    from transformers import AutoConfig

    from jaxserve.models.loader import build_abstract_model
    from jaxserve.ops.attention import resolve_attention
    from jaxserve.runner.aot import compile_bucket, step_shapes
    from jaxserve.runner.step_fn import make_step_fn

    hf_config = AutoConfig.from_pretrained(tiny_model_dir("llama"))
    abstract = build_abstract_model(hf_config, jnp.bfloat16, resolve_attention("auto", target_facts("h100")))
    shapes = step_shapes(abstract.cfg, jnp.dtype(jnp.bfloat16), 16, 64, 8, 32, max_drafts)
    step = make_step_fn(abstract.graphdef, jax.tree.structure(abstract.state), num_top_logprobs)
    hlo = compile_bucket(step, abstract.state, shapes, bucket, deviceless_device("h100")).compiled.as_text()
    return hlo, abstract.cfg.vocab_size


@pytest.mark.parametrize("max_drafts", [0, 4])  # without and with speculative decoding's draft counts
def test_the_h100_step_updates_the_penalty_tables_in_place(tiny_model_dir, max_drafts):
    """XLA:GPU copies a conditional's operands: the penalty tables' update behind a `lax.cond` copied both
    tables whole every step (64 MB at 256 sequences of GPT-2's vocabulary). On a CUDA target the update
    runs unconditionally, in place: the compiled step copies no array of the tables' shape. The sampler's
    logit processing has no pass-through branch: the logits are copied once, for the bias's scatter (the
    grammar mask and the bias behind conditionals of their own copied them three times). A draft row's
    penalties count the drafts before it by comparison, fused: no scatter writes the rows' counts out."""
    hlo, vocab_size = _tiny_llama_h100_step(tiny_model_dir, Bucket(4, 4, decode_only=True), 5, max_drafts)
    table = f"[32,{vocab_size}]"
    assert f"s32{table}" in hlo and not re.search(rf"= (s32|pred){re.escape(table)}\S* copy\(", hlo)
    assert len(re.findall(rf"= f32\[4,{vocab_size}\]\S* copy\(", hlo)) == 1
    assert not re.search(rf"= s32\[4,{vocab_size}\]\S* scatter\(", hlo)


def test_the_h100_step_takes_20_top_logprobs_with_the_topk_kernel_and_sorts_nothing(tiny_model_dir):
    """vLLM's default of 20 top logprobs, for the sampled tokens and the prompt's: XLA:GPU runs a top-k of
    at most 16 as its TopK kernel, and a larger one as a sort of each whole row of the vocabulary (more
    kernels to compile, a slower step). The step takes them 16 at a time (`selection.top_k`)."""
    hlo, vocab_size = _tiny_llama_h100_step(tiny_model_dir, Bucket(16, 4), 20)
    assert hlo.count('custom_call_target="__gpu$TopK"') == 4  # 16 + 4, for the samples and the prompt
    # (the attention kernels' launch order sorts a few work items: no sort of a vocabulary-wide row)
    sorts = [line.split(" sort(")[0] for line in hlo.splitlines() if " sort(" in line]
    assert not [shape for shape in sorts if f",{vocab_size}]" in shape] and "DeviceRadixSort" not in hlo


def _decode_kernel_args(device):
    sharding = on_one_device(device)

    def arg(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    pages = arg((8, 1024, 16, 128), jnp.bfloat16)  # Llama-3-8B's KV heads and head dim
    return arg((8, 32, 128), jnp.bfloat16), pages, pages, arg((8,), jnp.int32), arg((8, 512), jnp.int32)


def test_an_oversized_kernel_block_is_rejected():
    """A block of 2048 keys asks for ~1.1 MB of shared memory; an H100 has 227 KB per block. Lowering
    accepts it; only the real compile (Triton for sm_90) refuses it."""
    device = deviceless_device("h100")
    args = _decode_kernel_args(device)

    def kernel(block_kv: int):
        return jax.jit(functools.partial(
            paged_attention_pallas.paged_decode_attention_pallas, sm_scale=0.1, block_kv=block_kv, num_sms=132
        ))

    with jax.default_device(device):  # the GPU Pallas lowers for (jax >= 0.11; see runner/aot.compile_bucket)
        kernel(2048).trace(*args).lower()  # lowers fine
        with pytest.raises(Exception, match="RESOURCE_EXHAUSTED: Shared memory size limit exceeded"):
            kernel(2048).trace(*args).lower().compile()
        kernel(128).trace(*args).lower().compile()  # the default block compiles


def test_max_model_len_auto_compiles_the_page_tables_serve_would_run(tiny_model_dir):
    """`jaxserve compile --max-model-len auto`: as serve fits it, the model's context (the tiny Llama's 512)
    where the KV cache holds it, else what one request can hold there (8 usable pages of 16 tokens)."""
    options = dict(target=None, preset="cpu", dtype="float32", xla_cost=False, variants=False, max_model_len=-1,
                    buckets=[Bucket(1, 1, decode_only=True)])
    fitted, whole = (compile_ladder(str(tiny_model_dir("llama")), num_kv_pages=pages, **options) for pages in (9, 100))
    assert (fitted.max_model_len, whole.max_model_len) == (128, 512)


@pytest.mark.slow
def test_the_roofline_counts_agree_with_xla_cost_analysis():
    """The analytic flops of a prefill step against XLA's own count for the same step lowered for the CPU.

    XLA counts a while loop's body once, and the reference attention loops over KV blocks, so its count
    holds one block of attention: compare the weights' flops (context_len=1), which are most of a step's.
    XLA also counts the prompt-logprob branch, which a step takes only when a request asks for prompt
    logprobs and the roofline leaves out: XLA's count of that function alone is subtracted."""
    import jax.numpy as jnp

    from jaxserve.runner.prompt_logprobs import prompt_logprobs

    report = compile_ladder("gpt2", target=None, preset="gpu", dtype="float32", context_len=1,
                            buckets=[Bucket(512, 1), Bucket(2048, 1)])
    vocab, dim = 50257, 768
    # On a CPU the plain step leaves its sampler to a program of its own, one row per request bucket.
    assert [(b.variant, b.num_reqs) for b in report.buckets] == [("plain", 1), ("plain", 1), ("sampler", 1)]
    for bucket in report.buckets[:2]:
        t = bucket.num_tokens
        branch = jax.jit(lambda h, targets, w: prompt_logprobs(
            lambda x: jnp.einsum("RD,VD->RV", x, w), h, targets, vocab, 20)).trace(
            jax.ShapeDtypeStruct((t, dim), jnp.float32), jax.ShapeDtypeStruct((t,), jnp.int32),
            jax.ShapeDtypeStruct((vocab, dim), jnp.float32)).lower().cost_analysis()["flops"]
        assert bucket.xla_flops - branch == pytest.approx(bucket.flops, rel=0.1)


@pytest.mark.slow
def test_llama_3_8b_compiles_split_over_an_8_gpu_h100_node():
    """Tensor parallelism for real GPUs: the step split over 8 deviceless H100s (one node's topology),
    Pallas kernels per shard under shard_map, XLA's all-reduces after the output and down projections."""
    buckets = [Bucket(1, 1, decode_only=True)]
    report = compile_ladder("llama-3-8b", target="h100", preset="gpu", dtype="bfloat16", xla_cost=False,
                            variants=False, buckets=buckets, tensor_parallel_size=8)
    assert report.tensor_parallel_size == 8 and report.attention == "pallas"
    # Per device: an eighth of every split matrix; the norms (65 x 4096 values) are replicated.
    assert report.weights_bytes == (8_030_261_248 - 65 * 4096) * 2 // 8 + 65 * 4096 * 2
    (bucket,) = report.buckets
    assert bucket.collectives["all-reduce"] >= 2 * 32  # attention and MLP outputs in each of 32 layers
    assert bucket.predicted_seconds is None  # a roofline per device would ignore those all-reduces
    # One device holds 1 of the 8 KV heads of every page: the pages fit where a single GPU's could not.
    assert report.kv_budget.bytes_per_page == 32 * 2 * 16 * 128 * 2
    assert report.num_kv_pages > 256 * 8192 // 16


@pytest.mark.slow
def test_smollm2_with_padded_heads_compiles_split_over_two_h100s():
    """SmolLM2's 9 query / 3 KV heads become 12 / 6 to split in two: the decode kernel compiles for that layout
    under shard_map (the 8-GPU Llama-3-8B compile covers a mixed bucket's kernel split over devices, and sizes
    the KV cache split over devices: here the page count is given)."""
    buckets = [Bucket(16, 16, decode_only=True)]
    report = compile_ladder("smollm2-135m", target="h100", preset="gpu", dtype="bfloat16", xla_cost=False,
                            variants=False, buckets=buckets, tensor_parallel_size=2, num_kv_pages=180_000)
    assert [Bucket(b.num_tokens, b.num_reqs, b.decode_only) for b in report.buckets] == buckets
    assert all(b.collectives.get("all-reduce", 0) >= 2 * 30 for b in report.buckets)


@pytest.mark.slow
def test_an_fp8_cache_compiles_for_h100_and_is_refused_for_a100():
    """`--kv-cache-dtype fp8`: both kernels reading FP8 pages get through Triton and ptxas for sm_90, and a
    page is half a bfloat16 one (a budget, whose arithmetic the other compiles check, holds twice the pages);
    an A100 (compute capability 8.0, no FP8 conversions) is refused."""
    # Both kernels, the decode kernel at the preset's widest decode bucket; a narrower mixed bucket than the
    # preset's widest (SmolLM2's test compiles that, with a 16-bit cache) for the suite's time. The page count
    # is given (twice the 16-bit test's, the same bytes), which spares the budget's two sizing compiles.
    buckets = [Bucket(256, 16), Bucket(256, 256, decode_only=True)]
    options = dict(target="h100", preset="gpu", dtype="bfloat16", xla_cost=False, variants=False, buckets=buckets,
                   read_launches=False)
    fp8 = compile_ladder("smollm2-135m", kv_cache_dtype="fp8", num_kv_pages=360_000, **options)
    _check_report(fp8, buckets, launches_read=False, budgeted=False)
    # SmolLM2-135M: 30 layers of 3 KV heads of 64 dims; a bfloat16 page is twice this one (K and V, 1 byte).
    assert fp8.kv_cache_dtype == "float8_e4m3fn" and fp8.bytes_per_page == 2 * 30 * 3 * fp8.page_size * 64 * 1
    assert "pages of 16 tokens (float8_e4m3fn, 180 KiB) (--num-kv-pages)" in format_report(fp8)
    with pytest.raises(ValueError, match=r"compute capability >= 8\.9"):
        compile_ladder("smollm2-135m", kv_cache_dtype="fp8", **{**options, "target": "a100", "buckets": buckets[:1]})


@pytest.mark.parametrize(("name", "num_params"), [
    ("mixtral-8x7b", 46_702_792_704),  # Mixtral-8x7B's safetensors index: 93,405,585,408 bf16 bytes
    ("qwen3-30b-a3b", 30_532_122_624),  # Qwen3-30B-A3B's
    ("qwen1.5-moe-a2.7b", 14_315_784_192),  # Qwen1.5-MoE-A2.7B's 14.3B, its shared experts and their gates in
    ("granite-3.1-2b", 2_533_531_648),  # Granite 3.1 2B's 2.53B (tied embeddings)
    ("gpt-oss-20b", 20_914_757_184),  # gpt-oss-20b's 20.9B: sinks, biases and the experts' biases counted
    ("deepseek-v2-lite", 15_706_484_224),  # DeepSeek-V2-Lite's 15.7B: the latent projections, 2 shared experts
    ("glm-4.5-air", 106_852_251_264),  # GLM-4.5-Air's 106B (its model card), the multi-token prediction layer left out
    ("deepseek-v3", 671_026_419_200),  # DeepSeek-V3's 671B (its model card; 685B with its prediction layer)
])
def test_the_bundled_moe_shapes_hold_their_published_parameter_counts(name, num_params):
    """The shapes `jaxserve compile` and `--load-format dummy` take: every expert, router and norm counted."""
    from jaxserve.compile_ladder import load_model_config
    from jaxserve.models.loader import build_abstract_model
    from jaxserve.ops.attention import resolve_attention

    _, hf_config = load_model_config(name)
    abstract = build_abstract_model(hf_config, jnp.bfloat16, resolve_attention("auto", target_facts("h100")))
    assert abstract.num_params == num_params


def test_the_bundled_shapes_of_the_newer_families_read_as_their_configs_say():
    """Each family's own fields, read from its config.json as published: SmolLM3's every fourth layer without
    RoPE, OLMo 2's norms, Granite's multipliers, Qwen1.5-MoE's shared expert, GPT-OSS's sinks, alternating
    windows and YaRN, the first Gemma's query scale."""
    from jaxserve.compile_ladder import load_model_config
    from jaxserve.models.loader import build_abstract_model
    from jaxserve.ops.attention import resolve_attention

    def cfg(name):
        _, hf_config = load_model_config(name)
        return build_abstract_model(hf_config, jnp.bfloat16, resolve_attention("auto", target_facts("h100"))).cfg

    smollm3 = cfg("smollm3-3b")
    assert [i for i in range(36) if not smollm3.uses_rope(i)] == list(range(3, 36, 4))
    olmo2 = cfg("olmo-2-1b")
    assert olmo2.norm_after and olmo2.qk_norm == "all" and not olmo2.o_bias
    granite = cfg("granite-3.1-2b")
    assert (granite.embedding_multiplier, granite.residual_multiplier, granite.attention_multiplier,
            granite.logits_scaling) == (12.0, 0.22, 0.015625, 8.0)
    qwen2_moe = cfg("qwen1.5-moe-a2.7b")
    assert qwen2_moe.moe.shared_expert_size == 5632 and qwen2_moe.qkv_bias and not qwen2_moe.moe.normalize_top_k
    gpt_oss = cfg("gpt-oss-20b")
    assert gpt_oss.attention_sinks and gpt_oss.o_bias and gpt_oss.qkv_bias and gpt_oss.moe.softmax_after_top_k
    assert gpt_oss.sliding_windows == (128, None) * 12 and gpt_oss.rope.attention_factor == pytest.approx(1.3466, 1e-4)
    gemma = cfg("gemma-2b")
    assert not gemma.norms_after and gemma.sm_scale == 256**-0.5 and gemma.sliding_windows == (None,) * 18


@pytest.mark.slow
def test_lora_slots_compile_for_h100_inside_the_one_command_buffer():
    """`jaxserve compile --max-loras 4`: a LoRA server's greedy decode step, deviceless for an H100, is still
    one command buffer with no host sync; its weights grow by exactly the stacks' bytes, and its kernels by
    the stacks' dots (docs/benchmarks.md, stop 64, counts them). It compiles for an A100 too."""
    from jaxserve.compile_ladder import load_model_config
    from jaxserve.models.layers import LoraShape
    from jaxserve.models.loader import build_abstract_model
    from jaxserve.models.lora import abstract_with_lora
    from jaxserve.ops.attention import resolve_attention
    from jaxserve.runner.aot import compile_bucket, step_shapes
    from jaxserve.runner.step_fn import make_step_fn

    _, hf_config = load_model_config("smollm2-135m")
    plain = build_abstract_model(hf_config, jnp.bfloat16, resolve_attention("auto", target_facts("h100")))
    lora = abstract_with_lora(plain, LoraShape(4, 16), jnp.bfloat16)
    launches = {}
    for name, abstract in (("plain", plain), ("lora", lora)):
        shapes = step_shapes(abstract.cfg, jnp.dtype(jnp.bfloat16), 16, 4096, 64, 256)
        step = make_step_fn(abstract.graphdef, jax.tree.structure(abstract.state), 20, greedy=True)
        launches[name] = compile_bucket(step, abstract.state, shapes, Bucket(16, 16, decode_only=True),
                                        deviceless_device("h100"), read_launches=True).launches
    stacks = 30 * sum(d_in + d_out for d_in, d_out in ((576, 576), (576, 192), (576, 192), (576, 576),
                                                       (576, 1536), (576, 1536), (1536, 576)))
    assert lora.weights_bytes - plain.weights_bytes == stacks * 4 * 16 * 2  # bfloat16
    assert launches["lora"].host_ops == {"kCommandBuffer": 1} and launches["lora"].host_syncs == 0
    assert launches["lora"].num_kernels > launches["plain"].num_kernels + 7 * 30
    a100 = abstract_with_lora(build_abstract_model(hf_config, jnp.bfloat16, resolve_attention(
        "auto", target_facts("a100"))), LoraShape(4, 16), jnp.bfloat16)
    step = make_step_fn(a100.graphdef, jax.tree.structure(a100.state), 20, greedy=True)
    compiled = compile_bucket(step, a100.state, step_shapes(a100.cfg, jnp.dtype(jnp.bfloat16), 16, 4096, 64, 256),
                              Bucket(16, 16, decode_only=True), deviceless_device("a100"))
    assert compiled.temp_bytes > 0


@pytest.mark.slow
def test_the_shapes_estimate_covers_the_largest_buckets_compiled_for_an_h100():
    """A cold start sizes the KV cache from the step's shapes (runner/kv_sizing.py) and checks the real
    compiles against it with a margin; here the estimate alone covers what XLA:GPU's memory analysis gives
    the `gpu` preset's largest buckets for an H100 (2,048 tokens x 256 requests, and 256 decodes) of GPT-2,
    whose step the sampler dominates (Llama-3-8B's: in its compile test above)."""
    report = compile_ladder("gpt2", target="h100", preset="gpu", dtype="bfloat16", xla_cost=False, variants=False,
                            read_launches=False, num_kv_pages=20_000,
                            buckets=[Bucket(2048, 256), Bucket(256, 256, decode_only=True)])
    assert report.estimated_temp_bytes >= report.max_temp_bytes > 0
    assert report.estimated_temp_bytes < 1.5 * report.max_temp_bytes  # and costs at most a few hundred MiB


@pytest.mark.parametrize("method", ["mtp", "eagle"])
def test_a_drafter_beside_a_split_target_is_laid_out_as_serve_lays_it_out(method, tiny_model_dir, tmp_path):
    """The drafter `jaxserve compile` builds beside a target split over two H100s: its query heads split (an
    EAGLE drafter's one KV head replicated to two, one a device; the MTP layer's heads the target's), `fc` and
    `eh_proj` whole on each device, and a device's share of its own weights counted."""
    import numpy as np
    from flax import nnx, traverse_util
    from jax.sharding import Mesh

    from jaxserve.compile_ladder import _Drafter
    from jaxserve.device import deviceless_devices
    from jaxserve.models.loader import build_abstract_model, resolve_model_config
    from jaxserve.ops.attention import AttentionConfig
    from jaxserve.parallel import TP_AXIS
    from tests.eagle import write_eagle

    if method == "mtp":
        model, spec = tiny_model_dir("glm4-moe"), {"method": "mtp", "num_speculative_tokens": 3}
    else:
        model = tiny_model_dir("llama")
        write_eagle(tmp_path / "eagle", json.loads((model / "config.json").read_text()), num_key_value_heads=1)
        spec = {"method": "eagle", "model": str(tmp_path / "eagle"), "num_speculative_tokens": 3}
    _, hf = resolve_model_config(str(model), None, None)
    drafters = {}
    for tp in (1, 2):
        mesh = Mesh(np.asarray(deviceless_devices("h100", 2)), (TP_AXIS,)) if tp == 2 else None
        target = build_abstract_model(hf, jnp.bfloat16, AttentionConfig("pallas", num_sms=132, compute_capability=9.0,
                                                                        mesh=mesh))
        drafters[tp] = _Drafter.of(SpeculativeConfig.of(spec), target, jnp.bfloat16, None)
    leaves = traverse_util.flatten_dict(nnx.to_pure_dict(drafters[2].state))
    q_proj = next(leaf for path, leaf in leaves.items() if path[-1] == "q_proj")  # [D, N, H]
    assert q_proj.sharding.shard_shape(q_proj.shape)[1] == q_proj.shape[1] // 2
    whole = "eh_proj" if method == "mtp" else "fc"
    fused = next(leaf for path, leaf in leaves.items() if path[-1] == whole)
    assert fused.sharding.shard_shape(fused.shape) == fused.shape
    if method == "eagle":
        assert (drafters[1].cfg.num_kv_heads, drafters[2].cfg.num_kv_heads) == (1, 2)
    split_bytes = drafters[2].own_weights_bytes
    assert drafters[1].own_weights_bytes / 2 < split_bytes < drafters[1].own_weights_bytes


@pytest.mark.slow
@pytest.mark.parametrize("method", ["mtp", "eagle3"])
def test_a_drafter_compiles_split_over_the_target_s_devices(method, tiny_model_dir, tmp_path):
    """At --tensor-parallel-size 2 (two H100s, deviceless), the drafter's steps compile split as serve splits it:
    its layer's heads over the devices, so each of its steps all-reduces; a device holds half its weights, and
    half a page (the target's K/V and states, the drafter's own), as at TP=1."""
    if method == "mtp":
        model, spec = tiny_model_dir("glm4-moe"), {"method": "mtp", "num_speculative_tokens": 3}
    else:
        model = tiny_model_dir("llama")
        write_eagle3(tmp_path / "eagle3", json.loads((model / "config.json").read_text()), (0, 1),
                     draft_vocab_size=3000)
        spec = {"method": "eagle3", "model": str(tmp_path / "eagle3"), "num_speculative_tokens": 3}
    options = dict(target="h100", preset="gpu", dtype="bfloat16", xla_cost=False, variants=False,
                   buckets=[Bucket(8, 8, decode_only=True), Bucket(32, 8)], read_launches=False, num_kv_pages=1000,
                   speculative_config=SpeculativeConfig.of(spec))
    whole, split = (compile_ladder(str(model), tensor_parallel_size=tp, **options) for tp in (1, 2))
    assert [(r.num_tokens, r.variant) for r in split.buckets] == [(r.num_tokens, r.variant) for r in whole.buckets]
    drafts = [r for r in split.buckets if r.variant.startswith("draft")]
    assert len(drafts) == 4 and all(r.collectives.get("all-reduce", 0) >= 1 for r in drafts)
    assert split.bytes_per_page == whole.bytes_per_page // 2
    assert split.weights_bytes < 0.6 * whole.weights_bytes


@pytest.mark.parametrize("method", ["mtp", "eagle3"])
def test_a_drafter_of_the_target_s_states_compiles_beside_it_for_h100(method, tiny_model_dir, tmp_path):
    """GLM-4.5's own MTP layer (its config counts one) and an EAGLE-3 drafter beside a Llama (its config.json
    alone): the target's step keeps its hidden states in pages beside its K/V (EAGLE-3: two layers' inputs), the
    drafter's catch-up step compiles in every bucket and its k - 1 decode steps in one call in the decode ones,
    and a KV page counts the target's states and the drafter's own page, as serve sizes them."""
    if method == "mtp":
        model, drafter = tiny_model_dir("glm4-moe"), None
        width, drafter_layers = 64, 1  # the final hidden state; the layer's K/V beside its features
    else:
        model = tiny_model_dir("llama")
        drafter = tmp_path / "eagle3"
        write_eagle3(drafter, json.loads((model / "config.json").read_text()), (0, 1), draft_vocab_size=3000)
        width, drafter_layers = 2 * 64, 1
    buckets = [Bucket(8, 8, decode_only=True), Bucket(32, 8)]
    options = dict(target="h100", preset="gpu", dtype="bfloat16", xla_cost=False, variants=False,
                   buckets=buckets, read_launches=False, num_kv_pages=1000)
    spec = {"method": method, "num_speculative_tokens": 3} | ({"model": str(drafter)} if drafter else {})
    # without a drafter, the same draft rows: n-gram drafts of as many tokens
    plain = compile_ladder(str(model), speculative_config=SpeculativeConfig.of(
        {"method": "ngram", "num_speculative_tokens": 3}), **options)
    drafted = compile_ladder(str(model), speculative_config=SpeculativeConfig.of(spec), **options)
    kinds = [(r.num_tokens, r.variant) for r in drafted.buckets]
    assert kinds == [(8, "plain"), (32, "plain"), (8, "draft"), (32, "draft"), (8, "draft greedy"),
                     (8, "draft multi-step")]  # as the drafter's runner warms up (and runs) them
    page, kv_bytes = 16, 2 * 2 * 16 * 2  # tokens a page; K and V of 2 heads of 16, bfloat16, a token a layer
    assert drafted.bytes_per_page - plain.bytes_per_page == page * (width * 2 + drafter_layers * kv_bytes + 64 * 2)
    # its own weights, not the target's embeddings (49,152 x 64) it shares; its runner's penalty tables
    assert 0 < drafted.weights_bytes - plain.weights_bytes < 49152 * 64 * 2
    assert drafted.state_bytes == 2 * plain.state_bytes
    target_args = {r.num_tokens: r.argument_bytes for r in plain.buckets}
    assert all(r.argument_bytes - target_args[r.num_tokens] == 1000 * page * width * 2
               for r in drafted.buckets if r.variant == "plain")  # the target's states' pages, as arguments
