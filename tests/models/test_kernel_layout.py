"""Block-scaled FP8 weights stored K-major for Hopper's Mosaic GPU W8A8 kernel (`fp8_layout.kernel_layout`,
`AttentionConfig.fp8_block_mosaic`, JAXSERVE_MOSAIC_FP8_BLOCK=1): the layout keeps what a weight is, the rule
says where it applies, and a block-FP8 checkpoint laid out so computes what the Triton kernel computes from
the row-major weights, its large steps on the Mosaic GPU kernel (interpreted here) and its decodes on the
Triton kernel reading the same K-major values."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models import quantization
from jaxserve.models.fp8_layout import k_major, kernel_layout
from jaxserve.models.layers import dense
from jaxserve.models.quantization import Fp8Weight, quantize_fp8
from jaxserve.ops import fp8_block_matmul, fp8_block_matmul_mgpu
from jaxserve.ops.attention import AttentionConfig, cuda_compute_capability

ON_HOPPER = AttentionConfig(impl="pallas", compute_capability=cuda_compute_capability()).hopper


def test_the_layout_keeps_a_weight_s_shape_and_values():
    """A per-head projection [D, N, H] with 128 x 128 blocks: stored [N * H, D], it still reports its shape,
    reshapes to the [D, N * H] view a matmul takes, dequantizes to the same weight and goes back row-major
    unchanged; a ShapeDtypeStruct (a deviceless compile's) takes the stored shape."""
    w = quantize_fp8(jax.random.normal(jax.random.key(0), (256, 4, 32)), contracted=1, block=128)
    laid = k_major(w)
    assert laid.k_major and laid.values.shape == (128, 256) and laid.shape == (256, 4, 32) and laid.ndim == 3
    np.testing.assert_array_equal(np.asarray(laid.values, np.float32),
                                  np.asarray(w.values, np.float32).reshape(256, 128).T)
    np.testing.assert_array_equal(laid.dequantize(), w.dequantize())
    view = laid.reshape(256, -1)
    assert view.k_major and view.shape == (256, 128) and view.scale.shape == (2, 128)
    back = laid.row_major()
    assert not back.k_major and back.shape == w.shape
    np.testing.assert_array_equal(np.asarray(back.values, np.float32), np.asarray(w.values, np.float32))
    with pytest.raises(ValueError, match="K-major"):
        laid.reshape(128, -1)
    struct = Fp8Weight(jax.ShapeDtypeStruct((256, 4, 32), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((2, 4, 32),
                       jnp.float32), contracted=1, block=128)
    assert k_major(struct).values.shape == (128, 256) and k_major(struct).shape == (256, 4, 32)
    with pytest.raises(ValueError, match="dims"):
        Fp8Weight(laid.values, laid.scale, contracted=1, block=128, k_major=True)


def test_where_hopper_s_fp8_wgmma_kernel_serves(monkeypatch):
    """Only with JAXSERVE_MOSAIC_FP8_BLOCK=1, where FP8 activations are on: compiled on Hopper on one device,
    interpreted with the interpreted kernels; not on Ada or an A100, a mesh, a CPU, or with FP8 activations off."""
    monkeypatch.delenv("JAXSERVE_FP8_ACTIVATIONS", raising=False)
    hopper = AttentionConfig("pallas", compute_capability=9.0)
    monkeypatch.delenv("JAXSERVE_MOSAIC_FP8_BLOCK", raising=False)
    assert hopper.fp8_block_mosaic is None  # until a Hopper GPU has measured it
    monkeypatch.setenv("JAXSERVE_MOSAIC_FP8_BLOCK", "1")
    assert hopper.fp8_block_mosaic == "compiled"
    for other in (AttentionConfig("pallas", compute_capability=8.9), AttentionConfig("pallas", compute_capability=8.0),
                  dataclasses.replace(hopper, mesh=object()), AttentionConfig("cpu")):
        assert other.fp8_block_mosaic is None, other
    assert AttentionConfig("interpret").fp8_block_mosaic is None  # no FP8 activations off GPUs by default
    monkeypatch.setenv("JAXSERVE_FP8_ACTIVATIONS", "1")
    assert AttentionConfig("interpret").fp8_block_mosaic == "interpret"
    monkeypatch.setenv("JAXSERVE_FP8_ACTIVATIONS", "0")
    assert hopper.fp8_block_mosaic is None


@pytest.mark.skipif(jax.__version_info__ < (0, 11), reason="Mosaic GPU's interpreter runs from jax 0.11")
def test_a_block_fp8_checkpoint_laid_out_for_hopper_computes_as_the_triton_kernel(tiny_model_dir, tmp_path,
                                                                                   monkeypatch):
    """A DeepSeek-V3-style checkpoint (128 x 128 blocks) of a Llama whose projections are whole blocks, with FP8
    activations from 8 rows: a 20-token chunk and a decode after it. Laid out K-major, every block weight's
    chunk goes through the Mosaic GPU kernel and its decode through the Triton kernel reading K-major values;
    both give the logits the Triton kernel gives over the row-major weights (the same e4m3 products)."""
    from jaxserve.models.loader import load_model
    from tests.models.test_parity import PagedForward
    from tests.models.test_quantization import _write_fp8_checkpoint

    _write_fp8_checkpoint(tiny_model_dir("llama-128"), tmp_path / "fp8", block=(128, 128), fmt="fp8")
    monkeypatch.setenv("JAXSERVE_FP8_ACTIVATIONS", "1")
    monkeypatch.setattr(quantization, "W8A8_MIN_ROWS", 8)
    tokens, logits, calls = list(range(200, 221)), {}, {"mosaic": [], "k-major triton": []}
    for setting in ("0", "1"):
        monkeypatch.setenv("JAXSERVE_MOSAIC_FP8_BLOCK", setting)
        jax.clear_caches()  # the forward's trace reads them
        model = load_model(str(tmp_path / "fp8"), dtype="float32", attention_impl="interpret")
        block_weights = [leaf for leaf in jax.tree.leaves(model.state, is_leaf=lambda v: isinstance(v, Fp8Weight))
                         if isinstance(leaf, Fp8Weight) and leaf.block]
        laid_out = kernel_layout(model.state, model.cfg.attention)
        assert laid_out == (len(block_weights) if setting == "1" else 0) and block_weights
        if setting == "1":
            _spy(monkeypatch, calls)
        forward = PagedForward(model, list(range(1, 9)))
        logits[setting] = np.concatenate([forward(tokens[:20]), forward(tokens[20:])])  # [21, V]
    # (a layer's projections traced once for every layer alike: runner/step_fn.py)
    assert len(calls["mosaic"]) == len(calls["k-major triton"]) == len(block_weights) // model.cfg.num_layers
    assert min(calls["mosaic"]) >= 8 > max(calls["k-major triton"])  # the chunk's rows (padded), the decode's
    np.testing.assert_allclose(logits["1"], logits["0"], rtol=0, atol=1e-4 * np.abs(logits["0"]).max())


def _spy(monkeypatch, calls: dict[str, list[int]]) -> None:
    """Records the rows of each Mosaic GPU kernel call and each Triton block-kernel call on K-major values."""
    mosaic, triton = fp8_block_matmul_mgpu.fp8_block_matmul_mgpu, fp8_block_matmul.fp8_block_matmul

    def on_mosaic(x, *args, **kwargs):
        calls["mosaic"].append(x.shape[0])
        return mosaic(x, *args, **kwargs)

    def on_triton(x, *args, **kwargs):
        if kwargs.get("k_major"):
            calls["k-major triton"].append(x.shape[0])
        return triton(x, *args, **kwargs)

    monkeypatch.setattr(fp8_block_matmul_mgpu, "fp8_block_matmul_mgpu", on_mosaic)
    monkeypatch.setattr(fp8_block_matmul, "fp8_block_matmul", on_triton)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="the compiled kernels on a Hopper GPU")
@pytest.mark.parametrize("rows", [2, 2048])
def test_on_hopper_a_k_major_weight_s_product_is_the_row_major_one_s(rows, monkeypatch):
    """Compiled, as a Hopper step runs them: a Llama-3-8B q projection laid out K-major, through `layers.dense`
    (2,048 rows: e4m3 rows on the Mosaic GPU kernel's FP8 wgmma; 2 rows: the Triton kernel over K-major values),
    against float32 over the same operands (the rows as `quantize_rows` rounds them where they take e4m3)."""
    monkeypatch.setenv("JAXSERVE_FP8_ACTIVATIONS", "1")
    monkeypatch.setenv("JAXSERVE_MOSAIC_FP8_BLOCK", "1")
    attention = AttentionConfig("pallas", compute_capability=9.0)
    w = quantize_fp8(jax.random.normal(jax.random.key(0), (4096, 4096)) * 0.02, contracted=1, block=128)
    x = jax.random.normal(jax.random.key(1), (rows, 4096), jnp.bfloat16)
    got = jax.jit(lambda x, w: dense(x, w, attention))(x, k_major(w))
    if rows >= quantization.W8A8_MIN_ROWS:
        xq, x_scale = quantization.quantize_rows(x, 128)
        x = xq.astype(jnp.float32) * jnp.repeat(x_scale, 128, axis=1)
    want = x.astype(jnp.float32) @ w.dequantize(jnp.float32)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=0,
                               atol=1e-2 * float(np.abs(np.asarray(want, np.float32)).max()))


# Not `slow`: the interpreter runs from jax 0.11, which only the newest-jax job's fast suite has.
@pytest.mark.skipif(jax.__version_info__ < (0, 11), reason="Mosaic GPU's interpreter runs from jax 0.11")
def test_an_engine_lays_out_its_weights_and_keeps_its_greedy_tokens(tiny_model_dir, tmp_path, monkeypatch):
    """Through the engine, as serve runs it (interpreted): with JAXSERVE_MOSAIC_FP8_BLOCK=1 the runner stores the
    block weights K-major before its steps take them, its prefill goes through the Mosaic GPU kernel and its
    decodes through the K-major Triton kernel, and a request's greedy tokens are those of the engine that
    keeps the weights row-major (the same e4m3 products)."""
    from tests.engine.helpers import make_engine, run_alone
    from tests.models.test_quantization import _write_fp8_checkpoint

    _write_fp8_checkpoint(tiny_model_dir("llama-128"), tmp_path / "fp8", block=(128, 128), fmt="fp8")
    monkeypatch.setenv("JAXSERVE_FP8_ACTIVATIONS", "1")
    monkeypatch.setattr(quantization, "W8A8_MIN_ROWS", 8)
    prompt, tokens, laid_out, calls = list(range(300, 317)), {}, {}, {"mosaic": [], "k-major triton": []}
    for setting in ("0", "1"):
        monkeypatch.setenv("JAXSERVE_MOSAIC_FP8_BLOCK", setting)
        if setting == "1":
            _spy(monkeypatch, calls)
        engine = make_engine(tmp_path / "fp8", warmup=False, attention_impl="interpret", token_buckets=(16, 32),
                             request_buckets=(1,), max_num_seqs=1, max_num_batched_tokens=32)
        state = engine.runner.model.state
        laid_out[setting] = [leaf.k_major for leaf in jax.tree.leaves(state, is_leaf=lambda v: isinstance(v, Fp8Weight))
                             if isinstance(leaf, Fp8Weight)]
        tokens[setting] = run_alone(engine, prompt, 3)
    assert laid_out["1"] and all(laid_out["1"]) and not any(laid_out["0"])
    assert calls["mosaic"] and calls["k-major triton"]  # the prefill's products and the decodes'
    assert min(calls["mosaic"]) >= 8 > max(calls["k-major triton"])
    assert tokens["1"] == tokens["0"] and len(tokens["1"]) == 3


@pytest.mark.slow
def test_jaxserve_compile_lays_out_a_block_fp8_checkpoint_for_an_h100(monkeypatch):
    """`jaxserve compile --target h100` of Llama-3-8B's shape (one layer) as a 128 x 128 block-FP8 checkpoint,
    deviceless, with JAXSERVE_MOSAIC_FP8_BLOCK=1: the weights compile K-major as the runner lays them out, the
    2,048-token bucket's products go through the Mosaic GPU kernel (with e4m3 rows, which the roofline counts at
    the FP8 peak) and the decode bucket's through the K-major Triton kernel; with it 0, neither, and the same
    bytes."""
    from jaxserve.compile_ladder import compile_ladder
    from jaxserve.runner.buckets import Bucket

    calls = {"mosaic": [], "k-major triton": []}
    _spy(monkeypatch, calls)
    monkeypatch.delenv("JAXSERVE_FP8_ACTIVATIONS", raising=False)
    fp8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    reports, traced = {}, {}
    for setting in ("1", "0"):
        monkeypatch.setenv("JAXSERVE_MOSAIC_FP8_BLOCK", setting)
        for kind in calls.values():
            kind.clear()
        reports[setting] = compile_ladder(
            "llama-3-8b", target="h100", preset="gpu", dtype="bfloat16", xla_cost=False, variants=False,
            buckets=[Bucket(16, 16, decode_only=True), Bucket(2048, 16)], read_launches=False, num_kv_pages=4096,
            hf_overrides={"quantization_config": fp8, "num_hidden_layers": 1})
        traced[setting] = {name: sorted(set(rows)) for name, rows in calls.items()}
    assert traced == {"1": {"mosaic": [2048], "k-major triton": [16]}, "0": {"mosaic": [], "k-major triton": []}}
    (decode, mixed), (decode_row_major, mixed_row_major) = reports["1"].buckets, reports["0"].buckets
    assert reports["1"].weights_bytes == reports["0"].weights_bytes
    assert decode.predicted_seconds == decode_row_major.predicted_seconds
    assert mixed.bound == mixed_row_major.bound == "compute"
    layer_flops = 2 * 2048 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    assert mixed_row_major.predicted_seconds - mixed.predicted_seconds == pytest.approx(
        layer_flops / 989.4e12 - layer_flops / 1978.9e12, rel=1e-3)
