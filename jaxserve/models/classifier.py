"""Sequence classifiers: a causal family's stack with a classifier for a head (transformers'
`*ForSequenceClassification`: cross-encoder rerankers, reward and classification models), or a causal LM made
one from its LM head's rows of a few tokens (vLLM's `classifier_from_token`, which Qwen3-Reranker's and
bge-reranker-v2-gemma's official checkpoints are served with).

The head, `score` [L, D], reads a prompt's pooled final hidden state (`--runner pooling`, which a classifier
serves with), so a classifier's pooled vector is its L classes' logits. The family's config carries what the
head is (`ClassifierHead`, set by the loader from the HF config); the family's model class is wrapped
(`sequence_classifier`), and the checkpoint's tensors pass through `classifier_weights` and `map_weight`.
"""

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.layers import param

# vLLM's `method`s for a classifier made from tokens: the rows as they are, or (two tokens, false then true) the
# one row true - false, whose sigmoid is the softmax of the two tokens' logits (`is_original_qwen3_reranker`)
_METHODS = ("no_post_processing", "from_2_way_softmax")


@dataclass(frozen=True)
class ClassifierHead:
    """What a classifier's head is: its classes, and for one made from an LM head, the tokens whose rows it
    takes (`two_way`: the true token's row minus the false one's, one class)."""

    num_labels: int
    token_rows: tuple[int, ...] = ()
    two_way: bool = False


def is_classifier(hf_config: Any) -> bool:
    """Whether an HF config names a sequence classifier's architecture."""
    return any(name.endswith("ForSequenceClassification") for name in getattr(hf_config, "architectures", None) or ())


def classifier_head(hf_config: Any) -> ClassifierHead | None:
    """The head an HF config asks for (None: not a classifier). A classifier made from tokens reads their ids
    from `classifier_from_token_ids`, which the loader sets from the tokenizer (`token_ids`)."""
    rows = tuple(getattr(hf_config, "classifier_from_token_ids", None) or ())
    if not is_classifier(hf_config):
        if rows:
            raise ValueError("classifier_from_token makes a classifier: --hf-overrides must also set architectures "
                             "to a *ForSequenceClassification one")
        return None
    if not rows:
        return ClassifierHead(hf_config.num_labels)
    method = getattr(hf_config, "method", None) or "no_post_processing"
    if method not in _METHODS:
        raise ValueError(f"method must be one of {', '.join(_METHODS)} for classifier_from_token, got {method!r}")
    two_way = method == "from_2_way_softmax" or bool(getattr(hf_config, "is_original_qwen3_reranker", False))
    if two_way and len(rows) != 2:
        raise ValueError(f"a two-way classifier reads two tokens (false, true), got {len(rows)}")
    return ClassifierHead(1 if two_way else len(rows), rows, two_way)


def token_ids(tokens: Any, tokenizer: Any) -> list[int]:
    """Each of `tokens` (strings, each one token of `tokenizer`) as its id; raises ValueError naming one that
    is not a token."""
    if isinstance(tokens, str) or not tokens:
        raise ValueError(f"classifier_from_token must be a list of tokens, got {tokens!r}")
    ids = [tokenizer.convert_tokens_to_ids(token) for token in tokens]
    for token, token_id in zip(tokens, ids, strict=True):
        if not isinstance(token_id, int) or (token_id == tokenizer.unk_token_id and token != tokenizer.unk_token):
            raise ValueError(f"classifier_from_token: {token!r} is not a token of the model's tokenizer")
    return ids


def num_classes(cfg: Any) -> int:
    """A model config's classes; 0 for a model that does not classify."""
    head = getattr(cfg, "classifier", None)
    return head.num_labels if head is not None else 0


ACTIVATIONS = ("softmax", "sigmoid", "none")


def class_activation(hf_config: Any, num_labels: int) -> str:
    """What turns a classifier's logits into its outputs, as vLLM chooses it from the config: none for a
    regression (`problem_type`, a reward model's score), a sigmoid per class for a multi-label one and for a
    single class, else a softmax."""
    problem = getattr(hf_config, "problem_type", None)
    if problem == "regression":
        return "none"
    return "sigmoid" if problem == "multi_label_classification" or num_labels == 1 else "softmax"


# sentence-transformers' activations a cross-encoder's config may name, as its `activation_fn`
_SENTENCE_TRANSFORMERS_ACTIVATIONS = {"Identity": "none", "Sigmoid": "sigmoid", "Softmax": "softmax"}


def score_activation(hf_config: Any, num_labels: int) -> str:
    """What turns a cross-encoder's logit into its pair score (/score, /rerank), as vLLM chooses it: the
    activation its sentence-transformers config names (`sentence_transformers.activation_fn`, or the older
    `sbert_ce_default_activation_function`: Identity, Sigmoid), else `class_activation`'s."""
    settings = getattr(hf_config, "sentence_transformers", None)
    named = (settings.get("activation_fn") if isinstance(settings, dict) else None) or getattr(
        hf_config, "sbert_ce_default_activation_function", None)
    if isinstance(named, str) and (kind := named.rsplit(".", 1)[-1]) in _SENTENCE_TRANSFORMERS_ACTIVATIONS:
        return _SENTENCE_TRANSFORMERS_ACTIVATIONS[kind]
    return class_activation(hf_config, num_labels)


def class_labels(hf_config: Any, num_labels: int) -> tuple[str, ...]:
    """A classifier's label for each of its `num_labels` classes, in class order: its config's `id2label`, or
    for one made from tokens the tokens (a two-way one's: its true token)."""
    labels = {int(index): str(label) for index, label in (getattr(hf_config, "id2label", None) or {}).items()}
    if tokens := list(getattr(hf_config, "classifier_from_token", None) or ()):
        labels = dict(enumerate(tokens[-num_labels:]))
    return tuple(labels.get(index, f"LABEL_{index}") for index in range(num_labels))


def sequence_classifier(causal: type) -> type:
    """The classifier of a causal family's model class: its stack, no LM head, and `score`."""

    class SequenceClassifier(causal):
        def __init__(self, cfg: Any, dtype: Any, weight_dtype: Any = None) -> None:
            super().__init__(dataclasses.replace(cfg, tie_word_embeddings=True), dtype, weight_dtype)  # no lm_head
            self.cfg = cfg
            self.score = param(cfg.classifier.num_labels, cfg.hidden_size, dtype=weight_dtype or dtype)

        def compute_logits(self, hidden: jax.Array) -> jax.Array:  # [R, D] -> f32[R, V]
            """No LM head, and a pooling step asks for no logits (it draws no sample): equal logits, each row's
            first hidden value, for a generation step's shapes (not constants: XLA would fold a sampler over
            them)."""
            return jnp.broadcast_to(hidden[:, :1].astype(jnp.float32), (hidden.shape[0], self.cfg.vocab_size))

        def pool_head(self, pooled: jax.Array) -> jax.Array:  # f32[R, D] -> f32[R, L]
            """Pooled final hidden states (or their sums: the head is linear, without a bias) to class logits."""
            return jnp.einsum("rd,ld->rl", pooled, self.score[...].astype(jnp.float32))

    SequenceClassifier.__name__ = SequenceClassifier.__qualname__ = f"SequenceClassifier[{causal.__name__}]"
    return SequenceClassifier


_EMBEDDINGS = ("model.embed_tokens.weight", "embed_tokens.weight")


def classifier_weights(tensors: Iterator[tuple[str, Any]], cfg: Any) -> Iterator[tuple[str, Any]]:
    """A classifier's checkpoint tensors: for one made from tokens, the LM head's rows (the embeddings' where
    the head is tied) as `score.weight`; an LM head dropped (a classifier has none); any other model's tensors
    pass as they are."""
    head = getattr(cfg, "classifier", None)  # (families without classifiers have no field for it)
    if head is None:
        yield from tensors
        return
    source = (_EMBEDDINGS if cfg.tie_word_embeddings else ("lm_head.weight",)) if head.token_rows else ()
    for name, tensor in tensors:
        if name in source:
            rows = np.asarray(np.asarray(tensor)[list(head.token_rows)], np.float32)  # [k, D]
            yield "score.weight", rows[1:] - rows[:1] if head.two_way else rows
        if name != "lm_head.weight":
            yield name, tensor


def map_weight(name: str, cfg: Any) -> tuple[tuple[str, ...], Callable] | None:
    """Where a classifier's own tensor goes (its head, [L, D] as the model keeps it); None for the others."""
    if name == "score.weight" and getattr(cfg, "classifier", None) is not None:
        return ("score",), lambda w, c: w
    return None
