"""The FP8 KV cache (`--kv-cache-dtype fp8`, e4m3): the write saturates, every attention path that reads it
equals the float64 oracle over the cache's own FP8 values, and the choice is checked against the device (the
native CPU kernel reads no FP8; GPUs need compute capability >= 8.9); the per-layer scales folded into the
weights come from a calibration pass or from the checkpoint's own."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.device import local_facts
from jaxserve.ops.attention import (
    kv_cache_dtype,
    ragged_paged_attention,
    resolve_impl,
)
from jaxserve.ops.kv_write import to_cache_dtype, write_kv
from jaxserve.ops.paged_attention_pallas import paged_decode_attention_pallas, ragged_paged_attention_pallas
from tests.helpers import run_jitted
from tests.ops.paged_cases import MIXES, PagedCase, make_case, oracle
from tests.ops.test_paged_attention_pallas import PRODUCTION_HEADS, calls_triton, lower_for_cuda

FP8 = jnp.float8_e4m3fn
KERNEL_IMPL = "pallas" if resolve_impl("auto") == "pallas" else "interpret"


def fp8_case(case: PagedCase, q_dtype) -> PagedCase:
    """The case with its pages stored as FP8 (unused slots stay NaN) and its queries in `q_dtype`."""
    pages = [np.asarray(to_cache_dtype(jnp.asarray(p), FP8)) for p in (case.k_pages, case.v_pages)]
    return PagedCase(np.asarray(jnp.asarray(case.q).astype(q_dtype)), *pages, case.kv_lens, case.page_table,
                     case.cu_q_lens)


def widened(case: PagedCase) -> PagedCase:
    """What the oracle reads: the FP8 values themselves, exactly, in float32."""
    return PagedCase(np.asarray(case.q, np.float32), np.asarray(case.k_pages, np.float32),
                     np.asarray(case.v_pages, np.float32), case.kv_lens, case.page_table, case.cu_q_lens)


def test_the_write_saturates_at_e4m3s_largest_value_and_rounds_to_3_mantissa_bits():
    x = jnp.asarray([0.0, 1.0, -1.0, 0.3, 447.0, 448.0, 1e3, -1e6, 2.0**-9])
    got = np.asarray(to_cache_dtype(x, FP8).astype(jnp.float32))
    assert np.all(np.isfinite(got)), "a plain cast of a value past 448 gives NaN in float8_e4m3fn"
    np.testing.assert_array_equal(got[[0, 1, 2, 5, 6, 7]], [0.0, 1.0, -1.0, 448.0, 448.0, -448.0])
    assert abs(got[3] - 0.3) <= 0.3 * 2.0**-4  # round to nearest with 3 mantissa bits
    assert got[8] == 2.0**-9  # the smallest subnormal is kept
    # the same through the cache write, which is what every step does
    k_pages = jnp.zeros((1, 2, 4, 2), FP8)
    new = jnp.full((3, 1, 2), 1e4, jnp.bfloat16)
    k_pages, _ = write_kv(k_pages, k_pages, new, new, jnp.asarray([0, 5, 99], jnp.int32))
    flat = np.asarray(k_pages.astype(jnp.float32)).reshape(-1, 2)
    np.testing.assert_array_equal(flat[[0, 5]], 448.0)
    assert np.count_nonzero(flat) == 4, "the padding token's slot (past the cache) is dropped"


@pytest.mark.parametrize("impl", ["reference", "cpu"])
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_the_jnp_paths_read_an_fp8_cache_exactly(impl, mix):
    rng = np.random.default_rng(sorted(MIXES).index(mix))
    case = fp8_case(make_case(rng, *MIXES[mix], 6, 2), jnp.float32)
    got = np.asarray(run_jitted(ragged_paged_attention, *case.args, sm_scale=0.25, impl=impl))
    num_real = case.num_real_tokens
    np.testing.assert_allclose(got[:num_real], oracle(widened(case), 0.25)[:num_real], atol=2e-5, rtol=1e-5)
    assert np.all(got[num_real:] == 0)


@pytest.mark.slow  # interpreted on a CPU
@pytest.mark.gpu
@pytest.mark.parametrize("q_dtype,tol", [(np.float32, 1e-4), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("mix", ["decodes", "chunk_after_cache", "mixed_with_empty"])
def test_the_kernels_read_an_fp8_cache(mix, q_dtype, tol):
    """Both Pallas kernels, with queries in the model's dtype and FP8 pages widened in registers."""
    rng = np.random.default_rng(sorted(MIXES).index(mix))
    case = fp8_case(make_case(rng, *MIXES[mix], 8, 2, page_size=16, head_dim=64), q_dtype)
    want = oracle(widened(case), 0.125)
    num_real = case.num_real_tokens
    interpret = KERNEL_IMPL == "interpret"
    got = run_jitted(ragged_paged_attention_pallas, *case.args, sm_scale=0.125, interpret=interpret)
    got = np.asarray(jnp.asarray(got).astype(jnp.float32))
    assert np.all(np.isfinite(got)), "NaN from an unused FP8 slot leaked into the output"
    np.testing.assert_allclose(got[:num_real], want[:num_real], atol=tol, rtol=tol)
    if mix == "decodes":  # one query per request: the decode kernel too (its padding requests read nothing)
        q = case.q[: case.page_table.shape[0]]
        got = run_jitted(paged_decode_attention_pallas, q, *case.args[1:5], sm_scale=0.125, interpret=interpret,
                         num_splits=2)
        got = np.asarray(jnp.asarray(got).astype(jnp.float32))
        np.testing.assert_allclose(got[:4], want[:4], atol=tol, rtol=tol)


@pytest.mark.parametrize("model", ["llama-3-8b", "gpt2"])
def test_the_kernels_lower_for_an_h100_with_an_fp8_cache(model):
    num_q_heads, num_kv_heads, head_dim = PRODUCTION_HEADS[model]
    pages = ((num_kv_heads, 4096, 16, head_dim), FP8)
    ragged = lower_for_cuda(
        lambda *a: ragged_paged_attention_pallas(*a, sm_scale=0.1),
        ((2048, num_q_heads, head_dim), jnp.bfloat16), pages, pages,
        ((256,), jnp.int32), ((256, 512), jnp.int32), ((257,), jnp.int32),
    )
    decode = lower_for_cuda(
        lambda *a: paged_decode_attention_pallas(*a, sm_scale=0.1),
        ((256, num_q_heads, head_dim), jnp.bfloat16), pages, pages, ((256,), jnp.int32), ((256, 512), jnp.int32),
    )
    assert calls_triton(ragged) and calls_triton(decode)


def test_the_fp8_choice_is_checked_against_the_attention_path_and_the_device():
    assert kv_cache_dtype("fp8", jnp.bfloat16, "pallas", compute_capability=9.0) == FP8
    assert kv_cache_dtype("fp8_e4m3", jnp.float32, "cpu") == FP8
    assert kv_cache_dtype("fp8", jnp.bfloat16, "interpret") == FP8
    with pytest.raises(ValueError, match=r"compute capability >= 8\.9"):
        kv_cache_dtype("fp8", jnp.bfloat16, "pallas", compute_capability=8.0)  # an A100
    with pytest.raises(ValueError, match="--attention cpu"):
        kv_cache_dtype("fp8", jnp.float32, "cpu-native")
    with pytest.raises(ValueError, match="or fp8"):
        kv_cache_dtype("float16", jnp.bfloat16, "pallas", compute_capability=9.0)
    cpu = local_facts(jax.devices("cpu")[0])  # `auto` on a CPU: the jnp path for FP8, which the kernel can't read
    assert resolve_impl("auto", cpu, kv_cache_dtype="fp8") == "cpu"
    assert resolve_impl("auto", cpu, kv_cache_dtype="bfloat16") == resolve_impl("auto", cpu)
    assert resolve_impl("reference", cpu, kv_cache_dtype="fp8") == "reference"


def test_power_of_two_scales_leave_headroom_below_448():
    from jaxserve.models.kv_scales import HEADROOM, power_of_two_scale

    for amax in (0.43, 1.0, 20.0, 500.0, 3e-5):
        scale = power_of_two_scale(amax, 448.0)
        assert np.log2(scale) == round(np.log2(scale)), "a power of two, so scaling is exact"
        assert 448.0 / (2 * HEADROOM) < amax / scale <= 448.0 / HEADROOM
    assert power_of_two_scale(0.0, 448.0) == 1.0


@pytest.mark.parametrize("kind", ["llama", "gpt2", "qwen3", "deepseek-v2", "deepseek-v3"])
def test_folded_scales_change_no_output_and_fill_e4m3s_range(kind, tiny_model_dir):
    """Folding power-of-two scales into a layer's weights is exact: with a float32 cache the model gives the
    same tokens. With an FP8 cache the calibrated scales bring each layer's largest |K| and |V| into
    [112, 224] (448 over twice and once the headroom), where e4m3 keeps its 3 mantissa bits. DeepSeek's
    latent cache (one array, its values its keys) takes each layer's K scale alone."""
    from jaxserve.config import EngineConfig
    from jaxserve.models.kv_scales import calibrate_amax, fold_kv_scales
    from jaxserve.models.loader import load_model
    from tests.engine.helpers import make_engine, make_prompts, run_staggered

    directory = tiny_model_dir(kind)
    prompts, max_tokens, arrivals = make_prompts(4), [6, 5, 7, 4], [0, 0, 1, 2]
    # Both engines on one ladder: the folded model's steps are the plain one's programs (loaded from the
    # persistent cache), with other weights.
    ladder = dict(token_buckets=(16, 64), request_buckets=(1, 4), max_num_seqs=4, max_num_batched_tokens=64)
    plain = run_staggered(make_engine(directory, warmup=False, attention_impl="reference", **ladder), prompts,
                          max_tokens, arrivals)
    model = load_model(str(directory), "float32", "reference")
    rng = np.random.default_rng(0)
    scales = 2.0 ** rng.integers(-6, 7, (model.cfg.num_layers, 2)).astype(np.float32)
    fold_kv_scales(model, scales)
    config = EngineConfig.from_preset(None, model=str(directory), compilation_cache_dir=None, dtype="float32",
                                      attention_impl="reference", page_size=4, num_kv_pages=256, max_model_len=256,
                                      **ladder)
    from jaxserve.engine.llm_engine import LLMEngine

    folded = run_staggered(LLMEngine(config, model=model, warmup=False), prompts, max_tokens, arrivals)
    assert folded == plain

    fp8 = make_engine(directory, warmup=False, attention_impl="reference", kv_cache_dtype="fp8")
    calibrated = fp8.core.model
    assert calibrated.kv_scales is not None
    amax = calibrate_amax(calibrated)  # the folded model's own K and V, as the cache receives them
    assert np.all((amax > 448.0 / 4) & (amax <= 448.0 / 2)), amax


def test_checkpoint_kv_scale_names():
    from jaxserve.models.kv_scales import checkpoint_kv_scale

    assert checkpoint_kv_scale("model.layers.3.self_attn.k_scale") == (3, "k")
    assert checkpoint_kv_scale("model.layers.12.self_attn.v_scale") == (12, "v")
    assert checkpoint_kv_scale("transformer.h.0.attn.kv_scale") == (0, "kv")  # an older format: both
    assert checkpoint_kv_scale("h.7.attn.v_scale") == (7, "v")
    assert checkpoint_kv_scale("vision_model.encoder.layers.0.self_attn.k_scale") is None  # not the decoder's
    assert checkpoint_kv_scale("model.layers.0.self_attn.k_proj.k_scale") is None  # ModelOpt's: calibrated
    assert checkpoint_kv_scale("model.layers.3.self_attn.k_proj.weight_scale") is None
    assert checkpoint_kv_scale("model.layers.3.self_attn.k_proj.input_scale") is None
    # An FP8 checkpoint's stream drops the activations' static scales and passes the KV cache's on
    from jaxserve.models.quantization import fp8_checkpoint_tensors

    stream = [("model.layers.0.self_attn.k_scale", np.float32(0.1)),
              ("model.layers.0.self_attn.q_proj.input_scale", np.ones(1, np.float32))]
    assert [name for name, _ in fp8_checkpoint_tensors(iter(stream))] == ["model.layers.0.self_attn.k_scale"]


def _with_kv_scales(source, target, scales: dict[str, float]) -> None:
    """The tiny model's checkpoint with `scales` (tensor name -> value) added, as llm-compressor writes them."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    tensors = load_file(str(target / "model.safetensors"))
    tensors.update({name: torch.tensor(value, dtype=torch.float32) for name, value in scales.items()})
    save_file(tensors, str(target / "model.safetensors"))


def test_a_checkpoint_s_kv_scales_replace_the_calibration(tiny_model_dir, tmp_path, caplog):
    """A checkpoint calibrated for an FP8 cache (`k_scale`, `v_scale` per layer, vLLM's format): its scales,
    as powers of two with the calibration's headroom, are the ones folded. Scales written as llm-compressor
    writes them (each layer's largest |K| or |V| over 448) bring the cache's values where the calibration
    pass brings them; any other scales are taken as given."""
    import logging

    from jaxserve.models.kv_scales import calibrate_amax, checkpoint_amax
    from jaxserve.models.loader import load_model
    from tests.engine.helpers import make_engine

    source = tiny_model_dir("llama")
    amax = calibrate_amax(load_model(str(source), "float32", "reference"))  # f32[L, 2] of the unscaled model
    num_layers = len(amax)
    calibrated = {f"model.layers.{i}.self_attn.{kind}_scale": float(amax[i, j]) / 448.0
                  for i in range(num_layers) for j, kind in enumerate("kv")}
    _with_kv_scales(source, tmp_path / "calibrated", calibrated)
    with caplog.at_level(logging.INFO, "jaxserve.models.kv_scales"):
        engine = make_engine(tmp_path / "calibrated", warmup=False, attention_impl="reference", kv_cache_dtype="fp8")
    assert "from the checkpoint's k_scale and v_scale" in caplog.text
    folded = engine.core.model
    np.testing.assert_allclose(checkpoint_amax(folded.checkpoint_kv_scales, num_layers), amax, rtol=1e-6)
    cached = calibrate_amax(folded)  # what the cache receives now
    assert np.all((cached > 448.0 / 4) & (cached <= 448.0 / 2)), cached

    # Scales 8x and 1/8x the calibration's: the checkpoint's, not a calibration pass's
    skewed = {name: value * (8.0 if ".k_" in name else 0.125) for name, value in calibrated.items()}
    _with_kv_scales(source, tmp_path / "skewed", skewed)
    skewed_model = make_engine(tmp_path / "skewed", warmup=False, attention_impl="reference",
                               kv_cache_dtype="fp8").core.model
    np.testing.assert_array_equal(skewed_model.kv_scales[:, 0], folded.kv_scales[:, 0] * 8)
    np.testing.assert_array_equal(skewed_model.kv_scales[:, 1], folded.kv_scales[:, 1] / 8)


def test_a_cache_of_keys_alone_takes_a_checkpoint_s_k_scale_alone():
    """DeepSeek's latent cache is one array: a checkpoint's `k_scale` a layer is enough (its values are its
    keys); a K-and-V cache still needs both."""
    from jaxserve.models.kv_scales import checkpoint_amax

    found = {(0, "k"): 0.5, (1, "k"): 0.25}
    np.testing.assert_array_equal(checkpoint_amax(found, 2, keys_only=True), [[224.0, 224.0], [112.0, 112.0]])
    with pytest.raises(ValueError, match="no v_scale for layer 0"):
        checkpoint_amax(found, 2)


def test_kv_scales_for_only_some_layers_are_refused_by_an_fp8_cache_alone(tiny_model_dir, tmp_path):
    from tests.engine.helpers import make_engine

    _with_kv_scales(tiny_model_dir("llama"), tmp_path / "partial", {"model.layers.0.self_attn.k_scale": 0.01,
                                                                    "model.layers.0.self_attn.v_scale": 0.01})
    make_engine(tmp_path / "partial", warmup=False, attention_impl="reference")  # a float32 cache needs none
    with pytest.raises(ValueError, match="no k_scale for layer 1"):
        make_engine(tmp_path / "partial", warmup=False, attention_impl="reference", kv_cache_dtype="fp8")
