"""End to end: the engine with the Pallas kernels (interpreted on CPU, compiled on a CUDA GPU), and with
the CPU path, generates what the reference path does."""

import jax
import jax.numpy as jnp
import pytest

from jaxserve.ops import cpu_kernels, paged_attention_pallas
from jaxserve.ops.attention import resolve_impl
from tests.engine.helpers import make_engine, make_prompts, run_staggered

# Small enough that both kernels trace in a few seconds; prefill chunks, mixed steps and decode-only steps.
# One request bucket: an engine compiles at most four steps (two mixed, the decode and its greedy variant),
# each seconds of XLA:CPU on a cold cache, and this file builds 39 engines.
KERNEL_LADDER = dict(token_buckets=(16, 32), request_buckets=(4,), max_num_seqs=4, max_num_batched_tokens=32)
MAX_TOKENS = [9, 6, 12, 5, 8, 10]
ARRIVALS = [0, 0, 1, 3, 6, 7]


@pytest.fixture(scope="module")
def generate(tiny_model_dir):
    """(kind, attention impl) -> the greedy tokens of six staggered requests (prefill chunks, mixed and
    decode-only steps) on that path, and whether the native CPU kernel served any of its steps; each pair
    run once in this module: the generation tests compare their paths with the reference path's tokens,
    which they share."""
    outputs = {}

    def run(kind: str, impl: str) -> tuple[dict[int, list[int]], bool]:
        if (kind, impl) not in outputs:
            native_calls = []
            kernel = cpu_kernels.ragged_paged_attention
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(cpu_kernels, "ragged_paged_attention",
                              lambda *a, **kw: native_calls.append(1) or kernel(*a, **kw))
                jax.clear_caches()  # traced anew under the patch, not an earlier engine's trace (`_shared`)
                engine = make_engine(tiny_model_dir(kind), warmup=False, attention_impl=impl, **KERNEL_LADDER)
                tokens = run_staggered(engine, make_prompts(6), MAX_TOKENS, ARRIVALS)
            outputs[kind, impl] = tokens, bool(native_calls)
        return outputs[kind, impl]

    return run


@pytest.mark.slow  # the interpreted kernel, end to end
@pytest.mark.gpu  # the compiled kernel in the engine on a GPU
@pytest.mark.parametrize("kind", ["llama", "gpt2", "gemma2"])
def test_greedy_generation_with_the_kernel_equals_the_reference(kind, generate, monkeypatch):
    traced = {"ragged": 0, "decode": 0}

    def counting(name, kernel):
        def wrapper(*args, **kwargs):
            traced[name] += 1
            return kernel(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(paged_attention_pallas, "ragged_paged_attention_pallas",
                        counting("ragged", paged_attention_pallas.ragged_paged_attention_pallas))
    monkeypatch.setattr(paged_attention_pallas, "paged_decode_attention_pallas",
                        counting("decode", paged_attention_pallas.paged_decode_attention_pallas))
    kernel_impl = "pallas" if resolve_impl("auto") == "pallas" else "interpret"
    outputs, _ = generate(kind, kernel_impl)
    assert outputs == generate(kind, "reference")[0]
    assert [len(outputs[i]) for i in range(6)] == MAX_TOKENS
    assert traced["ragged"] > 0 and traced["decode"] > 0, "both kernels should have served steps"


@pytest.mark.cpu_only("the attention paths for CPUs")
@pytest.mark.parametrize("impl", ["cpu", "cpu-native"])
@pytest.mark.parametrize("kind", ["llama", "gpt2", "gemma2"])  # gemma2: windows and soft caps
def test_greedy_generation_with_the_cpu_paths_equals_the_reference(kind, impl, generate):
    """The CPU paths (the jnp work items, the native kernel) through prefill chunks, mixed and decode-only
    steps generate exactly the reference path's tokens."""
    if impl == "cpu-native" and (error := cpu_kernels.kernel_error()) is not None:
        pytest.skip(error)
    outputs, used_native = generate(kind, impl)
    reference, reference_used_native = generate(kind, "reference")
    assert outputs == reference
    assert [len(outputs[i]) for i in range(6)] == MAX_TOKENS
    assert used_native == (impl == "cpu-native") and not reference_used_native, (
        "the kernel serves cpu-native's steps, and only those")


@pytest.mark.cpu_only("the CPU paths and the CPU's KV budget (--kv-cache-memory)")
@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16"])
def test_a_16_bit_cache_under_a_float32_model(kv_cache_dtype, tiny_model_dir):
    """`kv_cache_dtype`: the pages are stored in 16 bits (twice as many in one memory budget), and the
    reference, the jnp CPU path and the native kernel all read those values in float32, so they generate
    the same tokens."""
    if (error := cpu_kernels.kernel_error()) is not None:
        pytest.skip(error)
    prompts = make_prompts(6)
    max_tokens, arrivals = MAX_TOKENS, ARRIVALS
    outputs = {}
    for impl in ("reference", "cpu", "cpu-native"):
        engine = make_engine(tiny_model_dir("llama"), warmup=False, attention_impl=impl, kv_cache_dtype=kv_cache_dtype,
                             **KERNEL_LADDER)
        assert {page.dtype for pair in engine.runner.kv_caches for page in pair} == {jnp.dtype(kv_cache_dtype)}
        outputs[impl] = run_staggered(engine, prompts, max_tokens, arrivals)
    assert outputs["cpu"] == outputs["reference"] == outputs["cpu-native"]
    assert [len(outputs["cpu-native"][i]) for i in range(6)] == max_tokens
    budget = dict(num_kv_pages=None, kv_cache_memory_gib=0.01, **KERNEL_LADDER)
    pages = {dtype: make_engine(tiny_model_dir("llama"), warmup=False, kv_cache_dtype=dtype, **budget).runner.num_pages
             for dtype in ("auto", kv_cache_dtype)}
    assert pages[kv_cache_dtype] // 2 == pages["auto"]


@pytest.mark.cpu_only("the CPU's default dtypes")
def test_all_auto_dtypes_on_a_cpu_with_bfloat16_dots_are_the_16_bit_settings(tiny_model_dir, monkeypatch):
    """Every dtype auto on a CPU that multiplies bfloat16 (faked here, so any CPU runs it): the engine runs
    bfloat16 weights and cache under float32 activations, the tokens of those settings given explicitly."""
    from jaxserve.models import loader

    monkeypatch.setattr(loader, "cpu_has_bf16_dots", lambda: True)
    prompts, max_tokens, arrivals = make_prompts(3), [6, 4, 5], [0, 0, 1]
    auto = make_engine(tiny_model_dir("llama"), warmup=False, dtype="auto", **KERNEL_LADDER)
    assert auto.runner.kv_dtype == jnp.bfloat16 and auto.model.weight_dtype == jnp.bfloat16
    assert auto.model.dtype == jnp.float32
    explicit = make_engine(tiny_model_dir("llama"), warmup=False, dtype="float32", weight_dtype="bfloat16",
                           kv_cache_dtype="bfloat16", **KERNEL_LADDER)
    assert run_staggered(auto, prompts, max_tokens, arrivals) == run_staggered(explicit, prompts, max_tokens,
                                                                                arrivals)
    monkeypatch.setattr(loader, "cpu_has_bf16_dots", lambda: False)
    plain = make_engine(tiny_model_dir("llama"), warmup=False, dtype="auto", **KERNEL_LADDER)
    assert plain.runner.kv_dtype == jnp.float32 and plain.model.weight_dtype == jnp.float32


# A bfloat16 model; bfloat16 weights under a float32 model (`weight_dtype`), whose activations the matmuls
# round to bfloat16 and whose cache stays float32.
SIXTEEN_BIT_WEIGHTS = {"bfloat16": dict(dtype="bfloat16"),
                       "bfloat16 weights": dict(dtype="float32", weight_dtype="bfloat16")}


@pytest.mark.cpu_only("the native CPU kernels")
@pytest.mark.parametrize(("kind", "setting", "same_tokens"), [
    *[(kind, setting, True) for kind in ("llama", "gpt2") for setting in SIXTEEN_BIT_WEIGHTS],
    ("deepseek-v2", "bfloat16 weights", True),
    # bfloat16 activations through a 576-dim latent: the two attention paths' sums part on one near-tied token
    ("deepseek-v2", "bfloat16", False)])
def test_bfloat16_weights_under_the_native_kernels(kind, setting, same_tokens, tiny_model_dir, monkeypatch):
    """bfloat16 weights on `cpu-native`: few-token steps' projections and LM head run in the native bfloat16
    matmul, K/V are written in place, and the model generates what the same weights generate through XLA's
    dots and the reference attention (bfloat16 operands, float32 sums in another order). DeepSeek's per-head
    up-projections are batched dots, which XLA:CPU cannot sum into float32 from 16-bit operands: both settings
    failed at the first step (the first is what `--dtype auto` asks for on a CPU with bfloat16 dots)."""
    if (error := cpu_kernels.kernel_error()) is not None:
        pytest.skip(error)
    calls = {"matmul": 0, "write": 0}
    matmul, write = cpu_kernels.matmul_bf16, cpu_kernels.write_kv
    monkeypatch.setattr(cpu_kernels, "matmul_bf16", lambda *a, **kw: calls.update(matmul=calls["matmul"] + 1) or
                        matmul(*a, **kw))
    monkeypatch.setattr(cpu_kernels, "write_kv", lambda *a, **kw: calls.update(write=calls["write"] + 1) or
                        write(*a, **kw))
    options = SIXTEEN_BIT_WEIGHTS[setting]
    prompts = make_prompts(6)
    max_tokens, arrivals = MAX_TOKENS, ARRIVALS
    outputs = {}
    for impl in ("reference", "cpu-native"):
        # Decodes of up to 8 tokens run the native matmul; the larger steps XLA's bfloat16 dot.
        engine = make_engine(tiny_model_dir(kind), warmup=False, attention_impl=impl, **options,
                             **{**KERNEL_LADDER, "token_buckets": (4, 8, 32)})
        leaf_dtypes = {leaf.dtype for leaf in jax.tree.leaves(engine.model.state)}
        cache_dtypes = {page.dtype for pair in engine.runner.kv_caches for page in pair if page is not None}
        if options["dtype"] == "bfloat16":
            assert leaf_dtypes == {jnp.dtype(jnp.bfloat16)}
        else:
            assert jnp.dtype(jnp.bfloat16) in leaf_dtypes and cache_dtypes == {jnp.dtype(jnp.float32)}
        outputs[impl] = run_staggered(engine, prompts, max_tokens, arrivals)
        if impl == "reference":
            assert calls == {"matmul": 0, "write": 0}, "only cpu-native takes the native kernels"
    if same_tokens:
        assert outputs["cpu-native"] == outputs["reference"]
    assert [len(outputs[impl][i]) for impl in outputs for i in range(6)] == max_tokens * 2
    assert calls["matmul"] > 0 and calls["write"] > 0


@pytest.mark.cpu_only("the CPU paths and the CPU's KV budget (--kv-cache-memory)")
def test_an_fp8_cache_on_a_cpu(tiny_model_dir):
    """`kv_cache_dtype="fp8"`: e4m3 pages, twice as many as bfloat16 ones in one budget; `auto` attention
    takes the jnp CPU path (the native kernel reads no FP8), which generates the reference path's tokens
    from the same FP8 values. (How close they stay to a 16-bit cache's is measured on the bundled model:
    benchmarks/greedy_agreement.py; this random tiny model's top logits are too close to keep its tokens.)"""
    prompts = make_prompts(6)
    max_tokens, arrivals = MAX_TOKENS, ARRIVALS
    outputs = {}
    for impl in ("auto", "reference"):
        engine = make_engine(tiny_model_dir("llama"), warmup=False, attention_impl=impl, kv_cache_dtype="fp8",
                             **KERNEL_LADDER)
        assert {page.dtype for pair in engine.runner.kv_caches for page in pair} == {jnp.dtype(jnp.float8_e4m3fn)}
        assert engine.model.cfg.attention.impl == ("cpu" if impl == "auto" else impl)
        outputs[impl] = run_staggered(engine, prompts, max_tokens, arrivals)
    assert outputs["auto"] == outputs["reference"]
    assert [len(outputs["auto"][i]) for i in range(6)] == max_tokens
    budget = dict(num_kv_pages=None, kv_cache_memory_gib=0.01, **KERNEL_LADDER)
    pages = {dtype: make_engine(tiny_model_dir("llama"), warmup=False, kv_cache_dtype=dtype, **budget).runner.num_pages
             for dtype in ("bfloat16", "fp8")}
    assert pages["fp8"] // 2 == pages["bfloat16"]


@pytest.mark.slow  # three engines
@pytest.mark.cpu_only("the attention paths for CPUs")
@pytest.mark.parametrize("impl", ["cpu-native"])  # the CPU default; the jnp path reads as the oracle tests show
def test_pages_released_outside_the_window_are_never_read(impl, tiny_model_dir, monkeypatch):
    """Mistral's every layer has a 7-token window, so requests release their pages before it as they grow,
    and a small pool hands those pages to other requests, which overwrite them, while the runner's page
    tables still name them. Greedy outputs equal the reference path's on a pool large enough that nothing is
    released, so no released page was read."""
    from jaxserve.engine.kv_cache_manager import KVCacheManager

    if impl == "cpu-native" and (error := cpu_kernels.kernel_error()) is not None:
        pytest.skip(error)
    prompts = make_prompts(6)
    max_tokens = [30, 24, 30, 20, 28, 30]
    arrivals = [0, 0, 1, 3, 6, 7]
    released = []
    release = KVCacheManager.release_outside_window
    monkeypatch.setattr(KVCacheManager, "release_outside_window",
                        lambda self, *a: released.append(release(self, *a)) or released[-1])
    small = make_engine(tiny_model_dir("mistral"), warmup=False, attention_impl=impl, num_kv_pages=26,
                        max_model_len=96, **KERNEL_LADDER)
    assert small.core.kv_cache.sliding_window == 7
    windowed = run_staggered(small, prompts, max_tokens, arrivals)
    assert sum(released) > 40, "requests released their pages outside the window"
    monkeypatch.setattr(KVCacheManager, "release_outside_window", lambda self, *a: 0)
    large = make_engine(tiny_model_dir("mistral"), warmup=False, attention_impl="reference", num_kv_pages=512,
                        max_model_len=96, **KERNEL_LADDER)
    assert run_staggered(large, prompts, max_tokens, arrivals) == windowed
