"""`--quantization gguf`: a GGUF file's layer weights, experts, LM head and token embeddings kept in their blocks
(every format the native kernel reads) and multiplied by it give the model the dequantized weights give it."""

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, traverse_util
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from jaxserve.models import layers
from jaxserve.models.gguf_weights import GgufExperts, GgufTable, GgufTensor, GgufWeight
from jaxserve.models.loader import load_model
from jaxserve.ops import cpu_kernels
from jaxserve.ops.attention import AttentionConfig
from tests.ops.test_matmul_gguf import rounded_activations

pytestmark = [
    pytest.mark.cpu_only("the native CPU kernels"),
    pytest.mark.skipif(cpu_kernels.kernel_error() is not None, reason=str(cpu_kernels.kernel_error())),
]


def _weight(kind: str, shape: tuple[int, ...], contracted: int, seed: int = 0) -> tuple[GgufWeight, np.ndarray]:
    """A GgufWeight of `shape` and its dequantized value f64[*shape]."""
    k, n = int(np.prod(shape[:contracted])), int(np.prod(shape[contracted:]))
    hf = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)  # [out, in]
    blocks = quantize(hf, GGMLQuantizationType[kind])
    want = dequantize(blocks, GGMLQuantizationType[kind]).astype(np.float64).T.reshape(shape)
    return GgufTensor(blocks, kind).as_weight(shape, contracted), want


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_dense_and_the_head_projections_multiply_by_the_dequantized_blocks(kind):
    """x rounded to 8 bits per block (the kernel's contract, `tests/ops/test_matmul_gguf.py`) times the
    dequantized weight, laid out over the parameter's axes."""
    attention = AttentionConfig(impl="cpu")
    x = np.random.default_rng(1).standard_normal((5, 64)).astype(np.float32)
    rounded = rounded_activations(x)
    dense, want = _weight(kind, (64, 96), 1)
    np.testing.assert_allclose(np.asarray(jax.jit(layers.dense, static_argnums=2)(x, dense, attention)),
                               rounded @ want, rtol=1e-5, atol=1e-4)
    heads, want = _weight(kind, (64, 4, 16), 1)  # [D, N, H]
    np.testing.assert_allclose(np.asarray(layers.project_heads(x, heads, attention)),
                               np.einsum("td,dnh->tnh", rounded, want), rtol=1e-5, atol=1e-4)
    out, want = _weight(kind, (4, 16, 32), 2)  # [N, H, D]
    np.testing.assert_allclose(np.asarray(layers.merge_heads(x.reshape(5, 4, 16), out, attention)),
                               np.einsum("tnh,nhd->td", rounded.reshape(5, 4, 16), want), rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(out.dequantize()), want.astype(np.float32))
    with pytest.raises(ValueError, match="reshapes to"):
        out.reshape(16, -1)


@pytest.mark.parametrize("kind", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"])
def test_a_k_quant_or_iq4_weight_and_lm_head_multiply_by_their_dequantized_blocks(kind):
    """The K-quants (llama.cpp's Q2_K, Q3_K_M, Q4_K_M and Q5_K_M files' formats) and IQ4_NL and IQ4_XS (its
    IQ4_XS files') kept as a layer weight and as an LM head: their scales and codes give, through the kernel, x rounded
    to 8 bits per block times the `gguf` package's dequantization."""
    from tests.ops.test_matmul_gguf import _blocks

    blocks = _blocks(kind, 96, 512, seed=4)  # [out, in]
    want = dequantize(blocks, GGMLQuantizationType[kind]).astype(np.float64).T  # [in, out]
    weight = GgufTensor(blocks, kind).as_weight((512, 96), 1)
    np.testing.assert_array_equal(np.asarray(weight.dequantize()), want.astype(np.float32))
    x = np.random.default_rng(6).standard_normal((3, 512)).astype(np.float32)
    got = jax.jit(layers.dense, static_argnums=2)(x, weight, AttentionConfig(impl="cpu"))
    np.testing.assert_allclose(np.asarray(got), rounded_activations(x) @ want, rtol=1e-5, atol=1e-4)
    head = GgufTensor(blocks, kind).as_table((96, 512))
    logits = jax.jit(lambda h, t: layers.logits_from_embeddings(h, t, AttentionConfig(impl="cpu")))(x, head)
    np.testing.assert_allclose(np.asarray(logits), rounded_activations(x) @ want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", list(cpu_kernels.GGUF_KINDS))
def test_an_embedding_table_kept_in_blocks_looks_up_and_multiplies_as_the_dequantized_one(kind):
    """Rows looked up from the packed blocks equal the dequantized table's bit for bit, in every kept format
    (ids at the edges of the 16-feature groups, repeated, and a vocabulary that is not a multiple of 16; the
    K-quants' random scales, codes and high bits, their zero row and subnormal scales); the logits are the
    hidden states rounded to 8 bits per block times the dequantized table."""
    from tests.ops.test_matmul_gguf import SUPER_KINDS, _blocks

    rng = np.random.default_rng(3)
    vocab, width = 53, 512 if kind in SUPER_KINDS else 96
    blocks = _blocks(kind, vocab, width, seed=3)
    want = dequantize(blocks, GGMLQuantizationType[kind]).astype(np.float32)  # [V, D]
    table = GgufTensor(blocks, kind).as_table((vocab, width))
    ids = jnp.asarray([0, 15, 16, 31, 32, 52, 7, 7, 1, 2], jnp.int32)
    got = jax.jit(layers.embedding_lookup)(table, ids)
    np.testing.assert_array_equal(np.asarray(got), want[np.asarray(ids)])
    hidden = rng.standard_normal((5, width)).astype(np.float32)
    logits = jax.jit(lambda h, t: layers.logits_from_embeddings(h, t, AttentionConfig(impl="cpu")))(hidden, table)
    assert logits.shape == (5, vocab) and logits.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(logits), rounded_activations(hidden) @ want.astype(np.float64).T,
                               rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(table.dequantize()), want)
    with pytest.raises(ValueError, match="does not fit"):
        GgufTensor(blocks, kind).as_table((vocab, 2 * width))


def test_a_tensor_that_does_not_fit_its_parameter_is_refused():
    blocks = quantize(np.ones((8, 64), np.float32), GGMLQuantizationType.Q8_0)
    with pytest.raises(ValueError, match="does not fit"):
        GgufTensor(blocks, "Q8_0").as_weight((32, 8), 1)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def _flat(loaded) -> dict:
    return traverse_util.flatten_dict(nnx.to_pure_dict(loaded.state))


@pytest.mark.slow
def test_the_bundled_model_keeps_its_q4_1_blocks_and_computes_the_same_logits(caplog):
    """Every kept weight decodes to exactly the parameter the dequantizing load builds (Q/K rows unpermuted,
    heads laid out), and the model's next-token choices match; the embeddings (Q8_0, also the tied LM head) and norms
    are dequantized as before, and the start-up log says so."""
    from tests.models.test_parity import PagedForward

    with caplog.at_level(logging.INFO, logger="jaxserve"):
        kept = load_model(None, dtype="float32", quantization="gguf")
    assert "quantization gguf: 210 Q4_1 layer weights and 1 Q8_0 embedding tables kept in their blocks" in caplog.text
    plain = load_model(None, dtype="float32")
    kept_flat, plain_flat = _flat(kept), _flat(plain)
    assert kept_flat.keys() == plain_flat.keys()
    quantized = [path for path, value in kept_flat.items() if isinstance(value, GgufWeight)]
    assert len(quantized) == 30 * 7 and all(kept_flat[p].kind == "Q4_1" for p in quantized)
    assert isinstance(kept_flat[("embed_tokens",)], GgufTable) and kept_flat[("embed_tokens",)].kind == "Q8_0"
    for path, value in kept_flat.items():
        expected = np.asarray(plain_flat[path])
        got = np.asarray(value.dequantize()) if isinstance(value, GgufWeight | GgufTable) else np.asarray(value)
        np.testing.assert_array_equal(got, expected, err_msg=str(path))
    # A second start reads the blocks from the cache the first one wrote (`iter_cached_gguf_tensors`).
    again = _flat(load_model(None, dtype="float32", quantization="gguf"))
    for path in quantized:
        assert again[path].kind == "Q4_1"
        np.testing.assert_array_equal(np.asarray(again[path].blocks), np.asarray(kept_flat[path].blocks))
    kept_bytes = sum(kept_flat[p].blocks.nbytes for p in quantized)
    plain_bytes = sum(plain_flat[p].nbytes for p in quantized)
    assert kept_bytes * 32 // 20 == plain_bytes // 4  # Q4_1: 20 bytes per 32 weights, against float32's 128
    # The kernel rounds activations to 8 bits per block of 32 (as llama.cpp does): the logits move a little,
    # the choices do not.
    prompt = kept.tokenizer.encode("Once upon a time, in a small village by the sea, there lived an old fisherman")
    got = log_softmax(PagedForward(kept, list(range(1, 9)))(prompt))
    want = log_softmax(PagedForward(plain, list(range(1, 9)))(prompt))
    top = want.argmax(-1)
    assert (got.argmax(-1) == top).all()
    # The drift compounds over 30 layers and each rounding to 8 bits can flip with the sums' order, so the bound
    # leaves room for another order of the same float32 sums; the kernel's own error is tested exactly.
    assert np.abs(got[np.arange(len(prompt)), top] - want[np.arange(len(prompt)), top]).max() < 0.5


def _kept_and_dequantized(path, arch: str, config, tensors: list, tokenizer_gguf) -> tuple:
    """A GGUF written from `tensors`, loaded with its kept formats in their blocks and fully dequantized."""
    from tests.models.test_gguf_families import write_gguf

    write_gguf(path, arch, config, tensors, tokenizer_gguf)
    return load_model(str(path), dtype="float32", quantization="gguf"), load_model(str(path), dtype="float32")


def assert_logits_follow(kept, plain) -> None:
    """The kept model's logits follow the dequantized one's. The kernels round activations to 8 bits per block
    (`test_dense_and_the_head_projections...` checks that contract exactly); through the random tiny models'
    two or three layers the logits stay close."""
    from tests.models.test_parity import PagedForward

    tokens = np.random.default_rng(5).integers(0, kept.cfg.vocab_size, size=19).tolist()
    got = PagedForward(kept, list(range(1, 9)))(tokens)
    want = PagedForward(plain, list(range(1, 9)))(tokens)
    assert np.abs(got - want).max() < 0.2 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.8


@pytest.mark.slow
def test_files_in_five_formats_of_32_weight_blocks_give_the_dequantized_model_s_logits(
        smollm2_gguf, tmp_path, monkeypatch):
    """A tiny Phi-3 GGUF whose projections are stored in five formats, layer by layer (its fused qkv and
    gate/up split by rows of blocks), its embeddings in Q8_0 and its LM head in Q5_0: each kept weight decodes to
    the parameter the dequantizing load builds, and the logits follow the dequantized model's."""
    from tests.models.test_gguf_families import gguf_name, tiny_model

    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    arch, hf = "phi3", tiny_model("phi3")
    kinds = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
    stored: dict[str, str] = {}
    tensors = []
    for name, tensor in hf.state_dict().items():
        array = tensor.numpy().astype(np.float32)
        tables = {"model.embed_tokens.weight": "Q8_0", "lm_head.weight": "Q5_0"}
        if (".layers." in name and name.endswith("proj.weight")) or name in tables:
            kind = tables.get(name) or kinds[len(stored) % len(kinds)]  # in turn: each layer starts elsewhere
            stored[gguf_name(name, arch)] = kind
            array = (quantize(array, GGMLQuantizationType[kind]), GGMLQuantizationType[kind])
        tensors.append((name, array))
    kept, plain = _kept_and_dequantized(tmp_path / f"tiny-{arch}.gguf", arch, hf.config, tensors, smollm2_gguf)
    kept_flat, plain_flat = _flat(kept), _flat(plain)
    weights = {path: v for path, v in kept_flat.items() if isinstance(v, GgufWeight)}
    assert {w.kind for w in weights.values()} == set(kinds) and len(weights) == 7 * hf.config.num_hidden_layers
    assert not hf.config.tie_word_embeddings
    assert {path: v.kind for path, v in kept_flat.items() if isinstance(v, GgufTable)} == {
        ("embed_tokens",): "Q8_0", ("lm_head",): "Q5_0"}
    weights.update({path: v for path, v in kept_flat.items() if isinstance(v, GgufTable)})
    for path, weight in weights.items():  # the blocks land where the dequantized values do, format by format
        np.testing.assert_array_equal(np.asarray(weight.dequantize()), np.asarray(plain_flat[path]), str(path))
    assert_logits_follow(kept, plain)


def test_auto_keeps_a_gguf_file_s_blocks_on_a_cpu_and_dequantizes_other_checkpoints(tiny_model_dir, caplog):
    """`--quantization auto` (the commands' default): gguf for a GGUF file here, none for safetensors; `none`
    dequantizes a GGUF file as the library's default does."""
    with caplog.at_level(logging.INFO, logger="jaxserve"):
        auto = load_model(None, dtype="float32", quantization="auto")
    assert auto.quantization == "gguf" and "quantization auto: gguf" in caplog.text
    assert isinstance(_flat(auto)[("embed_tokens",)], GgufTable)
    none = load_model(None, dtype="float32", quantization="none")
    assert none.quantization is None
    assert not any(isinstance(v, GgufWeight | GgufTable) for v in _flat(none).values())
    assert load_model(str(tiny_model_dir("llama")), dtype="float32", quantization="auto").quantization is None


def _tiny_qwen3(intermediate_size: int, tied: bool):
    """A random two-layer Qwen3 whose widths are whole K-quant super-blocks (hidden 256), seeded."""
    import torch
    import transformers

    from tests.conftest import TINY_VOCAB

    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=TINY_VOCAB, hidden_size=256, intermediate_size=intermediate_size, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
        tie_word_embeddings=tied, initializer_range=0.1)).eval()


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_q4_k_m_style_file_keeps_its_q6_k_head_and_projections(tied, smollm2_gguf, tmp_path, monkeypatch):
    """A tiny Qwen3 GGUF laid out as llama-quantize's Q4_K_M lays one out: the LM head (untied; tied, the token
    embeddings) and the V and down projections in Q6_K, the rest in Q8_0 (in place of Q4_K, which the gguf
    package does not write). The head (tied: the embeddings, looked up too) stays a Q6_K table and the
    projections Q6_K weights; each decodes to the parameter the dequantizing load builds, and the logits follow
    the dequantized model's."""
    from tests.ops.test_matmul_gguf import quantize_q6_k

    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    hf = _tiny_qwen3(intermediate_size=256, tied=tied)
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    tensors = []
    for name, tensor in hf.state_dict().items():
        array = tensor.numpy().astype(np.float32)
        if tied and name == "lm_head.weight":
            continue  # as llama.cpp writes a tied model: token_embd only
        if name == head or name.endswith(("v_proj.weight", "down_proj.weight")):
            array = (quantize_q6_k(array), GGMLQuantizationType.Q6_K)
        elif name.endswith("proj.weight") or name == "model.embed_tokens.weight":
            array = (quantize(array, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
        tensors.append((name, array))
    kept, plain = _kept_and_dequantized(tmp_path / "tiny-qwen3.gguf", "qwen3", hf.config, tensors, smollm2_gguf)
    kept_flat, plain_flat = _flat(kept), _flat(plain)
    kinds = {path[-1]: v.kind for path, v in kept_flat.items() if isinstance(v, GgufWeight | GgufTable)}
    tables = {"embed_tokens": "Q6_K"} if tied else {"embed_tokens": "Q8_0", "lm_head": "Q6_K"}
    assert kinds == {**tables, "v_proj": "Q6_K", "down_proj": "Q6_K",
                     **{name: "Q8_0" for name in ("q_proj", "k_proj", "o_proj", "gate_proj", "up_proj")}}
    for path, weight in kept_flat.items():
        if isinstance(weight, GgufWeight | GgufTable):
            np.testing.assert_array_equal(np.asarray(weight.dequantize()), np.asarray(plain_flat[path]), str(path))
    assert_logits_follow(kept, plain)


# Formats as llama-quantize lays them out: the LM head in Q6_K; per projection (the token embeddings as q's) a
# format, and IQ4_NL where a row is not whole super-blocks of 256 (the down projections' 96 inputs here).
LLAMA_QUANTIZE_LAYOUTS = {
    "IQ4_XS": dict.fromkeys(("q", "k", "v", "o", "gate", "up", "down"), "IQ4_XS"),
    "Q2_K": {**dict.fromkeys(("q", "k", "gate", "up", "down"), "Q2_K"), "v": "Q3_K", "o": "Q3_K"},
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LLAMA_QUANTIZE_LAYOUTS))
def test_an_iq4_xs_or_q2_k_file_keeps_every_tensor_in_its_blocks(layout, smollm2_gguf, tmp_path, monkeypatch):
    """A tiny Qwen3 GGUF laid out as llama-quantize's IQ4_XS or Q2_K lays one out (`LLAMA_QUANTIZE_LAYOUTS`).
    Every tensor stays in its blocks, dequantizes to the parameter the dequantizing load builds, and the
    logits follow the dequantized model's."""
    from tests.ops import test_matmul_gguf as quantizers

    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    hf = _tiny_qwen3(intermediate_size=96, tied=False)
    projections = LLAMA_QUANTIZE_LAYOUTS[layout]
    tensors, want = [], {}
    for name, tensor in hf.state_dict().items():
        array = tensor.numpy().astype(np.float32)
        projection = re.search(r"(\w+)_proj\.weight$", name)
        if name == "lm_head.weight":
            kind = "Q6_K"
        elif projection or name == "model.embed_tokens.weight":
            kind = projections[projection.group(1) if projection else "q"] if array.shape[1] % 256 == 0 else "IQ4_NL"
        else:
            tensors.append((name, array))
            continue
        want[name.split(".")[-2]] = kind
        tensors.append((name, (getattr(quantizers, f"quantize_{kind.lower()}")(array), GGMLQuantizationType[kind])))
    kept, plain = _kept_and_dequantized(tmp_path / f"tiny-{layout}.gguf", "qwen3", hf.config, tensors, smollm2_gguf)
    kept_flat, plain_flat = _flat(kept), _flat(plain)
    kinds = {path[-1]: v.kind for path, v in kept_flat.items() if isinstance(v, GgufWeight | GgufTable)}
    assert kinds == want and "IQ4_NL" in kinds.values()
    for path, weight in kept_flat.items():
        if isinstance(weight, GgufWeight | GgufTable):
            np.testing.assert_array_equal(np.asarray(weight.dequantize()), np.asarray(plain_flat[path]), str(path))
    assert_logits_follow(kept, plain)


@pytest.mark.slow
def test_auto_on_a_gguf_file_with_no_kept_format_dequantizes(smollm2_gguf, tmp_path, monkeypatch, caplog):
    """A GGUF file whose tensors are all float (F32 here, F16 or IQ3_XXS alike) keeps nothing: `auto` then says so
    and the model reports no quantization (the roofline reads the weights' bytes from it)."""
    from tests.models.test_gguf_families import tiny_model, write_gguf

    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    hf = tiny_model("phi3")
    path = tmp_path / "tiny-f32.gguf"
    write_gguf(path, "phi3", hf.config, [(n, t.numpy().astype(np.float32)) for n, t in hf.state_dict().items()],
               smollm2_gguf)
    with caplog.at_level(logging.INFO, logger="jaxserve"):
        loaded = load_model(str(path), dtype="float32", quantization="auto")
    assert loaded.quantization is None and "no tensor in a kept format, so none" in caplog.text


def test_gguf_quantization_is_refused_where_it_cannot_run(tiny_model_dir):
    with pytest.raises(ValueError, match=r"must be a \.gguf file"):
        load_model(str(tiny_model_dir("llama")), dtype="float32", quantization="gguf")
    with pytest.raises(ValueError, match="one device"):
        load_model(None, dtype="float32", quantization="gguf", tensor_parallel_size=2)


def test_the_native_kernel_is_the_only_matmul_in_a_kept_weight_s_step():
    """The step's HLO multiplies kept weights through the custom call, not through a dot over widened values."""
    w, _ = _weight("Q4_1", (64, 96), 1)
    hlo = jax.jit(lambda x, w: layers.dense(x, w, AttentionConfig(impl="cpu"))).lower(
        jnp.ones((3, 64), jnp.float32), w).as_text()
    assert "jaxserve_matmul_gguf" in hlo and "dot_general" not in hlo


@pytest.mark.parametrize("per_expert", [False, True], ids=["qwen3moe, stacked", "mixtral, one tensor an expert"])
def test_a_mixture_s_experts_stay_in_their_blocks_and_give_the_dequantized_model_s_logits(
        per_expert, smollm2_gguf, tmp_path, monkeypatch):
    """A tiny Qwen3-MoE GGUF (experts stacked, as llama.cpp stores them) and a tiny Mixtral one (one tensor an
    expert, as older files hold them, stacked as blocks at load) whose experts are Q8_0 (gate), Q4_0 (up) and
    Q4_1 (down): each kind stays in its blocks (`GgufExperts`), decodes to the parameter the dequantizing load
    builds, and the logits follow the dequantized model's."""
    import torch
    import transformers

    from tests.conftest import TINY_VOCAB
    from tests.models.test_gguf_families import experts_as_llama_cpp_stores_them

    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    torch.manual_seed(0)
    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
                  initializer_range=0.3, num_experts_per_tok=2)
    if per_expert:
        arch, hf = "llama", transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **common, intermediate_size=64, num_local_experts=4, sliding_window=None)).eval()
    else:
        arch, hf = "qwen3moe", transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **common, intermediate_size=128, head_dim=16, num_experts=4, moe_intermediate_size=64,
            norm_topk_prob=True)).eval()
    kinds = {"gate": "Q8_0", "up": "Q4_0", "down": "Q4_1"}
    tensors = []
    for name, array in experts_as_llama_cpp_stores_them(hf, per_expert):
        expert = re.search(r"(?:experts_|\.expert\.\d+\.)(gate|up|down)", name)  # stacked, or one expert's
        kind = GGMLQuantizationType[kinds[expert.group(1)]] if expert else None
        tensors.append((name, (quantize(array, kind), kind) if kind else array))
    kept, plain = _kept_and_dequantized(tmp_path / f"tiny-{arch}.gguf", arch, hf.config, tensors, smollm2_gguf)
    kept_flat, plain_flat = _flat(kept), _flat(plain)
    experts = {path: v for path, v in kept_flat.items() if isinstance(v, GgufExperts)}
    assert {path[-1]: v.kind for path, v in experts.items()} == {f"experts_{k}": v for k, v in kinds.items()}
    assert len(experts) == 3 * hf.config.num_hidden_layers
    for path, weight in experts.items():
        np.testing.assert_array_equal(np.asarray(weight.dequantize()), np.asarray(plain_flat[path]), str(path))
    assert_logits_follow(kept, plain)


def test_kept_experts_multiply_through_the_grouped_kernel_only():
    """A mixture's kept experts: the grouped GGUF kernel three times, no dot over widened values, and the
    rows routed to each expert times its dequantized blocks (x rounded to 8 bits per block)."""
    from jaxserve.models.moe import grouped_matmul

    rng = np.random.default_rng(3)
    hf = rng.standard_normal((3, 48, 64)).astype(np.float32)  # [E, out, in]
    blocks = quantize(hf, GGMLQuantizationType.Q8_0)
    w = GgufTensor(blocks, "Q8_0").as_experts((3, 64, 48))
    rows = rng.standard_normal((7, 64)).astype(np.float32)
    sizes = jnp.asarray([2, 0, 4], jnp.int32)
    got = np.asarray(grouped_matmul(jnp.asarray(rows), w, sizes))
    weights = np.asarray(w.dequantize(), np.float64)  # [E, in, out]
    want = np.concatenate([rounded_activations(rows[:2]) @ weights[0], rounded_activations(rows[2:6]) @ weights[2],
                           np.zeros((1, 48))])
    np.testing.assert_allclose(got, want, atol=1e-4)
    hlo = jax.jit(grouped_matmul).lower(jnp.asarray(rows), w, sizes).as_text()
    assert "jaxserve_grouped_matmul_gguf" in hlo and "dot_general" not in hlo and "ragged" not in hlo


def test_a_layer_mixing_kept_experts_and_bfloat16_ones_stays_on_the_native_kernels():
    """A layer may keep gate and up in blocks while its down projection, in a format not kept (an IQ3_M file's
    IQ3_S), is dequantized to bfloat16: the float32 rows the blocks take are rounded to bfloat16 for the latter's
    native kernel, never sent to a dense `ragged_dot` over widened weights."""
    from jaxserve.models.moe import grouped_expert_mlp

    rng = np.random.default_rng(4)
    gate, up = (GgufTensor(quantize(rng.standard_normal((3, 32, 64)).astype(np.float32), GGMLQuantizationType.Q8_0),
                           "Q8_0").as_experts((3, 64, 32)) for _ in range(2))
    down = jnp.asarray(rng.standard_normal((3, 32, 64)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.float32)
    weights, experts = jnp.full((5, 2), 0.5), jnp.asarray(rng.integers(0, 3, (5, 2)), jnp.int32)
    step = jax.jit(lambda x, w, e, g, u, d: grouped_expert_mlp(x, w, e, g, u, d, num_experts=3, native=True))
    hlo = step.lower(x, weights, experts, gate, up, down).as_text()
    assert hlo.count("jaxserve_grouped_matmul_gguf") == 2 and hlo.count("jaxserve_grouped_matmul_bf16") == 1
    assert "ragged" not in hlo
    got = np.asarray(step(x, weights, experts, gate, up, down))
    dense = {name: np.asarray(w.dequantize(), np.float64) for name, w in (("gate", gate), ("up", up))}
    want = np.zeros((5, 64))
    for t in range(5):
        for e in np.asarray(experts[t]):
            xt = rounded_activations(np.asarray(x[t:t + 1]))[0]
            h, u = xt @ dense["gate"][e], xt @ dense["up"][e]
            want[t] += 0.5 * (h / (1 + np.exp(-h)) * u) @ np.asarray(down[e], np.float64)
    np.testing.assert_allclose(got, want, atol=0.05 * np.abs(want).max())
