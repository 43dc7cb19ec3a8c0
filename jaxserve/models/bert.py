"""Encoder-only transformers: BERT (`BertModel`, `BertForSequenceClassification`) and RoBERTa / XLM-RoBERTa
(`RobertaModel`, `XLMRobertaModel` and their `*ForSequenceClassification`), in Flax NNX. They serve embedding
models (sentence-transformers' all-MiniLM, bge, e5, multilingual-e5) and cross-encoder rerankers
(ms-marco-MiniLM, bge-reranker) through `--runner pooling`, which an encoder always takes.

An encoder reads a prompt whole and in both directions: every token attends to every token of its prompt, so a
prompt is never split over steps (the scheduler's `whole_prompts`) and nothing is cached from one step for the
next. A step attends in one dense product over its tokens, masked to each prompt (`ops.encoder_attention`), or
on a CPU where that pays, through the paged kernels with each token a request of one query over its prompt's
pages (`each_token_a_row`, `pages_pay`), written as the step's scratch. The engine keeps only as many pages as
two steps' prompts take, which is what its scheduler counts (`engine/pooling_mode.encoder_config`).

Token types (BERT's segment embeddings): a pair, as the tokenizer encodes it for a cross-encoder
(`[CLS] a [SEP] b [SEP]`), is type 0 up to and with its first separator and type 1 after it. The step
derives them so from the separator token (`token_types`) rather than carrying a column of its own; a single
text is type 0 throughout unless it holds the separator itself, where the tokenizer would say 0.

Axis letters: T tokens, D hidden, N heads, H head dim, F MLP width, V vocab, L classes.
"""

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.models.classifier import ClassifierHead
from jaxserve.models.layers import (
    AttentionMetadata,
    KVCache,
    LayerNorm,
    apply_layers,
    dense,
    embedding_lookup,
    merge_heads,
    paged_attention,
    param,
    project_heads,
)
from jaxserve.ops.attention import AttentionConfig
from jaxserve.ops.encoder_attention import encoder_attention, token_rows
from jaxserve.parallel import SplitRule

# HF's hidden_act -> the activation (`jax.nn.gelu`'s exact erf form is BERT's "gelu")
_ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
}
_ROBERTA_TYPES = ("roberta", "xlm-roberta")
_QKV = (("query", "q"), ("key", "k"), ("value", "v"))  # HF's names of the attention's parts, and this model's


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    layer_norm_eps: float
    max_position_embeddings: int  # the longest prompt: the table's rows past `position_offset`
    num_position_rows: int  # the position table's rows
    position_offset: int  # RoBERTa's positions start past its padding index (padding_idx + 1); BERT's at 0
    type_vocab_size: int
    hidden_act: str
    # The token that ends a pair's first text (the tokenizer's sep_token_id), where token types are read
    separator_token_id: int | None = None
    attention: AttentionConfig = field(default_factory=AttentionConfig)  # resolved for the compile device
    classifier: ClassifierHead | None = None  # set by the loader for `*ForSequenceClassification`
    roberta: bool = False  # RoBERTa's and XLM-R's classifier head (`classifier.dense`, `.out_proj`), not BERT's
    tie_word_embeddings: bool = True  # (no LM head: what `classifier.classifier_weights` asks)

    is_encoder = True  # (a class attribute: the engine reads it to serve the model as an encoder)

    @property
    def num_kv_heads(self) -> int:
        return self.num_heads

    @property
    def reads_token_types(self) -> bool:
        return self.type_vocab_size > 1 and self.separator_token_id is not None

    @classmethod
    def from_hf(cls, hf: Any, attention: AttentionConfig | None = None) -> "BertConfig":
        if getattr(hf, "hidden_act", "gelu") not in _ACTIVATIONS:
            raise ValueError(f"unsupported encoder activation {hf.hidden_act!r}; jaxserve supports "
                             f"{', '.join(_ACTIVATIONS)}")
        position_type = getattr(hf, "position_embedding_type", "absolute") or "absolute"
        if position_type != "absolute":
            raise ValueError(f"unsupported position_embedding_type {position_type!r}: only absolute positions")
        roberta = hf.model_type in _ROBERTA_TYPES
        offset = hf.pad_token_id + 1 if roberta else 0  # (RoBERTa's tokenizers give no token types)
        return cls(
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            head_dim=hf.hidden_size // hf.num_attention_heads,
            layer_norm_eps=hf.layer_norm_eps,
            max_position_embeddings=hf.max_position_embeddings - offset,
            num_position_rows=hf.max_position_embeddings,
            position_offset=offset,
            type_vocab_size=getattr(hf, "type_vocab_size", 1) or 1,
            hidden_act=getattr(hf, "hidden_act", "gelu"),
            separator_token_id=None if roberta else getattr(hf, "sep_token_id", None),
            roberta=roberta,
            attention=attention or AttentionConfig(),
        )

    def with_heads(self, num_heads: int, num_kv_heads: int) -> "BertConfig":
        """The same model with its heads laid out for tensor parallelism (`jaxserve.parallel.HeadLayout`)."""
        if num_kv_heads != num_heads:
            raise ValueError("an encoder has as many KV heads as query heads")
        return dataclasses.replace(self, num_heads=num_heads)


def token_types(input_ids: jax.Array, cu_q_lens: jax.Array, rows: jax.Array, separator: int) -> jax.Array:
    """Each token's type (i32[T]): 1 past its prompt's first `separator`, else 0 (the module's docstring).
    `rows`: each token's prompt (`token_rows`); a prompt's tokens are all in the step, from cu_q_lens[row]."""
    is_separator = (input_ids == separator).astype(jnp.int32)
    before = jnp.cumsum(is_separator) - is_separator  # i32[T]: separators before each token in the step
    at_start = before[jnp.clip(cu_q_lens[jnp.clip(rows, 0, cu_q_lens.shape[0] - 2)], 0, input_ids.shape[0] - 1)]
    return jnp.minimum(before - at_start, 1)


# The attention paths on which an encoder may attend through the KV pages (`each_token_a_row`): the CPU's, whose
# kernels read each prompt's own keys (sum of the prompts' squares) where the step's dense product reads every
# prompt's (T x T). A pair costs the kernel ~4x what it costs the dense product, so the pages pay from about
# 5 prompts a step of 512 tokens, and at any count in longer steps, where the dense product is bound by memory
# (`pages_pay`; docs/benchmarks.md). GPUs keep the dense product, on the tensor cores.
PAGED_ON = ("cpu", "cpu-native")
PAGED_MIN_ROWS = 16  # a step's request bucket from which it holds 5 prompts or more (the ladders' 4, 16)
PAGED_MIN_TOKENS = 1024


def pages_pay(attention: AttentionConfig, num_tokens: int, num_rows: int) -> bool:
    """Whether a step of `num_tokens` tokens and `num_rows` request rows (its bucket's) attends through the
    pages (`PAGED_ON`)."""
    return attention.impl in PAGED_ON and (num_rows >= PAGED_MIN_ROWS or num_tokens >= PAGED_MIN_TOKENS)


def each_token_a_row(md: AttentionMetadata, rows: jax.Array) -> AttentionMetadata:
    """The step's metadata with each token a request of one query over its whole prompt (i32[T] `rows`:
    `token_rows`): paged attention that is causal per request is then bidirectional per prompt, each query
    seeing all of its prompt's keys, which the step writes to the pages first. Padding tokens stay padding:
    requests of no query and no key past the real tokens."""
    num_rows, num_tokens = md.kv_lens.shape[0], rows.shape[0]
    row = jnp.minimum(rows, num_rows - 1)
    cu_q_lens = jnp.minimum(jnp.arange(num_tokens + 1, dtype=jnp.int32), md.cu_q_lens[-1])
    return AttentionMetadata(slot_mapping=md.slot_mapping, kv_lens=jnp.where(rows < num_rows, md.kv_lens[row], 0),
                             page_table=md.page_table[row], cu_q_lens=cu_q_lens, decode_only=False)


class EncoderLayer(nnx.Module):
    """A post-norm layer: x = LN(x + attention(x)); x = LN(x + MLP(x))."""

    def __init__(self, cfg: BertConfig, dtype: Any, weight_dtype: Any) -> None:
        d, n, h, f = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.intermediate_size
        self.q_proj, self.k_proj, self.v_proj = (param(d, n, h, dtype=weight_dtype) for _ in range(3))
        self.q_bias, self.k_bias, self.v_bias = (param(n, h, dtype=dtype) for _ in range(3))
        self.o_proj = param(n, h, d, dtype=weight_dtype)
        self.o_bias = param(d, dtype=dtype)
        self.attention_norm = LayerNorm(d, cfg.layer_norm_eps, dtype)
        self.up_proj = param(d, f, dtype=weight_dtype)
        self.up_bias = param(f, dtype=dtype)
        self.down_proj = param(f, d, dtype=weight_dtype)
        self.down_bias = param(d, dtype=dtype)
        self.output_norm = LayerNorm(d, cfg.layer_norm_eps, dtype)
        self.attention = cfg.attention
        self.hidden_act = cfg.hidden_act

    def __call__(self, x: jax.Array, kv_cache: Any, rows: jax.Array, md: AttentionMetadata
                 ) -> tuple[jax.Array, Any]:  # [T, D]
        attention = self.attention
        q, k, v = (project_heads(x, w[...], attention) + b[...]
                   for w, b in ((self.q_proj, self.q_bias), (self.k_proj, self.k_bias), (self.v_proj, self.v_bias)))
        if pages_pay(attention, x.shape[0], md.kv_lens.shape[0]):  # each token a query over its prompt's pages
            attn, kv_cache = paged_attention(q, k, v, kv_cache, each_token_a_row(md, rows), attention=attention)
        else:
            attn = encoder_attention(q, k, v, rows)  # [T, N, H]
        x = self.attention_norm(x + merge_heads(attn, self.o_proj[...], attention) + self.o_bias[...])
        hidden = _ACTIVATIONS[self.hidden_act](dense(x, self.up_proj[...], attention) + self.up_bias[...])
        return self.output_norm(x + dense(hidden, self.down_proj[...], attention, split_contracted=True)
                                + self.down_bias[...]), kv_cache


class BertModel(nnx.Module):
    """The encoder; with `cfg.classifier`, a sequence classifier whose head reads the first token's final hidden
    state: tanh(W1 x + b1), then the classes' logits (BERT's pooler and classifier, RoBERTa's classifier's
    dense and out_proj: the same two layers)."""

    def __init__(self, cfg: BertConfig, dtype: Any, weight_dtype: Any = None) -> None:
        """`dtype`: activations, norms, biases, position and type embeddings; `weight_dtype` (None: `dtype`): the
        projections and the token embeddings."""
        weight_dtype = weight_dtype or dtype
        d = cfg.hidden_size
        self.cfg = cfg
        self.dtype = dtype
        self.word_embeddings = param(cfg.vocab_size, d, dtype=weight_dtype)
        self.position_embeddings = param(cfg.num_position_rows, d, dtype=dtype)
        self.token_type_embeddings = param(cfg.type_vocab_size, d, dtype=dtype)
        self.embeddings_norm = LayerNorm(d, cfg.layer_norm_eps, dtype)
        self.layers = nnx.List([EncoderLayer(cfg, dtype, weight_dtype) for _ in range(cfg.num_layers)])
        if cfg.classifier is not None:
            self.head_dense = param(d, d, dtype=weight_dtype)
            self.head_dense_bias = param(d, dtype=dtype)
            self.score = param(cfg.classifier.num_labels, d, dtype=weight_dtype)
            self.score_bias = param(cfg.classifier.num_labels, dtype=dtype)

    def __call__(
        self,
        input_ids: jax.Array,  # i32[T]
        positions: jax.Array,  # i32[T]
        kv_caches: KVCache,
        md: AttentionMetadata,
    ) -> tuple[jax.Array, KVCache]:  # [T, D]
        cfg = self.cfg
        rows = token_rows(md.cu_q_lens, input_ids.shape[0])  # i32[T]
        x = embedding_lookup(self.word_embeddings[...], input_ids, cfg.attention.mesh).astype(self.dtype)
        x = x + self.position_embeddings[...][jnp.clip(positions + cfg.position_offset, 0, cfg.num_position_rows - 1)]
        if cfg.reads_token_types:
            x = x + self.token_type_embeddings[...][token_types(input_ids, md.cu_q_lens, rows, cfg.separator_token_id)]
        else:
            x = x + self.token_type_embeddings[...][0]
        return apply_layers(self.layers, self.embeddings_norm(x), kv_caches, rows=rows, md=md)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:  # [R, D] -> f32[R, V]
        """No LM head, and a pooling step asks for no logits (it draws no sample): equal logits, each row's first
        hidden value, for a generation step's shapes (not constants: XLA would fold a sampler over them)."""
        return jnp.broadcast_to(hidden[:, :1].astype(jnp.float32), (hidden.shape[0], self.cfg.vocab_size))

    def pool_head(self, pooled: jax.Array) -> jax.Array:  # f32[R, D] -> f32[R, L]
        """A classifier's head over pooled first-token states (not linear: a sum of states means nothing); the
        states as they are for an embedding model (f32[R, D])."""
        if self.cfg.classifier is None:
            return pooled
        f32 = jnp.float32
        hidden = jnp.tanh(pooled @ self.head_dense[...].astype(f32) + self.head_dense_bias[...].astype(f32))
        return jnp.einsum("rd,ld->rl", hidden, self.score[...].astype(f32)) + self.score_bias[...].astype(f32)


LAYERS_KEY = "layers"
# `--quantization fp8`: the layers' dense weights, each with its number of contracted axes (`quantization.py`).
QUANTIZED_WEIGHTS = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 2, "up_proj": 1, "down_proj": 1}

# Tensor parallelism (`jaxserve.parallel`): parameter name -> (axis split over devices, what it holds).
TENSOR_PARALLEL: dict[str, SplitRule] = {
    "word_embeddings": (0, None), "position_embeddings": (None, None), "token_type_embeddings": (None, None),
    "scale": (None, None), "bias": (None, None),
    "q_proj": (1, "q"), "k_proj": (1, "kv"), "v_proj": (1, "kv"), "o_proj": (0, "q"),
    "q_bias": (0, "q"), "k_bias": (0, "kv"), "v_bias": (0, "kv"), "o_bias": (None, None),
    "up_proj": (1, None), "up_bias": (0, None), "down_proj": (0, None), "down_bias": (None, None),
    "head_dense": (None, None), "head_dense_bias": (None, None), "score": (None, None), "score_bias": (None, None),
}


def _heads_in(w: np.ndarray, c: BertConfig) -> np.ndarray:  # torch's [N*H, D] -> [D, N, H]
    return np.asarray(w).T.reshape(c.hidden_size, c.num_heads, c.head_dim)


def _per_head(b: np.ndarray, c: BertConfig) -> np.ndarray:  # [N*H] -> [N, H]
    return np.asarray(b).reshape(c.num_heads, c.head_dim)


_TRANSPOSED = lambda w, c: np.asarray(w).T  # noqa: E731  (torch's Linear keeps [out, in])
_SAME = lambda w, c: w  # noqa: E731


def _norm(path: tuple[str, ...]) -> dict[str, tuple[tuple[str, ...], Callable]]:
    """A LayerNorm's tensors under both of HF's names (weight/bias, and the older gamma/beta)."""
    return {"weight": ((*path, "scale"), _SAME), "gamma": ((*path, "scale"), _SAME),
            "bias": ((*path, "bias"), _SAME), "beta": ((*path, "bias"), _SAME)}


_LAYER_MAP: dict[str, tuple[tuple[str, ...], Callable]] = {
    **{f"attention.self.{name}.weight": ((f"{part}_proj",), _heads_in) for name, part in _QKV},
    **{f"attention.self.{name}.bias": ((f"{part}_bias",), _per_head) for name, part in _QKV},
    "attention.output.dense.weight": (("o_proj",),
                                      lambda w, c: np.asarray(w).T.reshape(c.num_heads, c.head_dim, c.hidden_size)),
    "attention.output.dense.bias": (("o_bias",), _SAME),
    "intermediate.dense.weight": (("up_proj",), _TRANSPOSED),
    "intermediate.dense.bias": (("up_bias",), _SAME),
    "output.dense.weight": (("down_proj",), _TRANSPOSED),
    "output.dense.bias": (("down_bias",), _SAME),
    **{f"attention.output.LayerNorm.{k}": v for k, v in _norm(("attention_norm",)).items()},
    **{f"output.LayerNorm.{k}": v for k, v in _norm(("output_norm",)).items()},
}
_TOP_MAP: dict[str, tuple[tuple[str, ...], Callable]] = {
    "embeddings.word_embeddings.weight": (("word_embeddings",), _SAME),
    "embeddings.position_embeddings.weight": (("position_embeddings",), _SAME),
    "embeddings.token_type_embeddings.weight": (("token_type_embeddings",), _SAME),
    **{f"embeddings.LayerNorm.{k}": v for k, v in _norm(("embeddings_norm",)).items()},
}
# A classifier's head: BERT's pooler and classifier, or RoBERTa's classifier (dense, out_proj; a RoBERTa
# checkpoint's pooler, which some keep, is not read)
_BERT_HEAD_MAP: dict[str, tuple[tuple[str, ...], Callable]] = {
    "pooler.dense.weight": (("head_dense",), _TRANSPOSED),
    "pooler.dense.bias": (("head_dense_bias",), _SAME),
    "classifier.weight": (("score",), _SAME),
    "classifier.bias": (("score_bias",), _SAME),
}
_ROBERTA_HEAD_MAP: dict[str, tuple[tuple[str, ...], Callable]] = {
    "classifier.dense.weight": (("head_dense",), _TRANSPOSED),
    "classifier.dense.bias": (("head_dense_bias",), _SAME),
    "classifier.out_proj.weight": (("score",), _SAME),
    "classifier.out_proj.bias": (("score_bias",), _SAME),
}
_PREFIX_RE = re.compile(r"^(?:bert\.|roberta\.|model\.)?")
_LAYER_RE = re.compile(r"^encoder\.layer\.(\d+)\.(.+)$")


def map_hf_weight(name: str, cfg: BertConfig) -> tuple[tuple[str | int, ...], Callable] | None:
    """Where an HF tensor goes in this model, or None for what it does not keep (buffers, an embedding model's
    pooler, a masked-LM head). Names come with the task model's prefix (`bert.`, `roberta.`) or without it
    (a sentence-transformers checkpoint of the bare encoder)."""
    short = _PREFIX_RE.sub("", name, count=1)
    if match := _LAYER_RE.match(short):
        entry = _LAYER_MAP.get(match.group(2))
        return None if entry is None else (("layers", int(match.group(1)), *entry[0]), entry[1])
    if short in _TOP_MAP:
        return _TOP_MAP[short]
    if cfg.classifier is None:
        return None
    return (_ROBERTA_HEAD_MAP if cfg.roberta else _BERT_HEAD_MAP).get(short)
