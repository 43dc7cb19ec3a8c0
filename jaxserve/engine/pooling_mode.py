"""How an engine serves a model once it is read: generation or pooling (`--runner auto`), how a pooled prompt's
hidden states become its vector (`--pooling-type auto`), and what an encoder (`models.bert`) changes: its
prompts whole in one step, so steps as long as its longest prompt, and a KV cache of only the pages its steps in
flight take (its layers keep nothing in them).
"""

import dataclasses
import logging

from jaxserve.config import AUTO_MAX_MODEL_LEN, EngineConfig, extend_ladder
from jaxserve.models import is_encoder
from jaxserve.models.classifier import num_classes
from jaxserve.models.loader import LoadedModel
from jaxserve.models.pooling_config import max_seq_length, pooling_type
from jaxserve.models.source import ModelSource, metadata_dir

logger = logging.getLogger(__name__)


def resolved_runner(config: EngineConfig, model: LoadedModel) -> EngineConfig:
    """The config with `--runner auto` resolved as vLLM resolves it: pooling for a classifier (its classes are
    a pooled vector's) and for an encoder, else generate; raises ValueError for a model that only pools asked to
    generate, or where pooling cannot be served (across hosts, with --enable-lora)."""
    classifies, encoder = num_classes(model.cfg) > 0, is_encoder(model.cfg)
    if not (classifies or encoder):
        return config if config.runner != "auto" else dataclasses.replace(config, runner="generate")
    what = "a classifier" if classifies else "an encoder"
    why = ("its architecture ends in ForSequenceClassification" if classifies
           else "it embeds, and generates no text")
    if config.runner == "generate":
        raise ValueError(f"the model is {what} ({why}): --runner generate cannot serve it; --runner pooling (or "
                         "auto) does")
    if config.parallel.multihost or config.lora.enable_lora:
        raise ValueError(f"the model is {what} ({why}), which --runner pooling serves, on one host and without "
                         "--enable-lora")
    if config.runner == "auto":
        served = "/classify, /score, /rerank" if classifies else "/v1/embeddings, /score, /rerank"
        logger.info("the model is %s: serving it with --runner pooling (%s)", what, served)
    return dataclasses.replace(config, runner="pooling")


def resolved_pooling_type(asked: str, model: LoadedModel) -> str:
    """`--pooling-type` with auto resolved: the model's sentence-transformers pooling where it has one, else
    the first token's for an encoder (BERT's [CLS]; a classifier's head reads it) and the last token's for a
    decoder. Raises ValueError for a pooling that the model's classifier head cannot read (a non-linear head
    reads one token's state, not a sum)."""
    first_only = is_encoder(model.cfg) and num_classes(model.cfg) > 0
    if asked == "auto":
        own = None if first_only else pooling_type(metadata_dir(model.source))
        resolved = own or ("cls" if is_encoder(model.cfg) else "last")
        logger.info("pooling: %s (%s)", resolved, "its sentence-transformers pooling" if own else "the model's")
    elif first_only and asked != "cls":
        raise ValueError(f"--pooling-type {asked}: the model's classifier head reads its first token's state "
                         "(--pooling-type cls, or auto)")
    else:
        resolved = asked
    if resolved == "cls" and not is_encoder(model.cfg):
        logger.warning("pooling: cls on a decoder, whose first token sees only itself: every prompt that starts "
                       "with the same token gets the same vector (--pooling-type last or mean)")
    return resolved


def encoder_context(positions: int, source: ModelSource) -> int:
    """The longest prompt an encoder reads: its `positions`, or its sentence-transformers `max_seq_length` where
    shorter (serve and a deviceless compile alike)."""
    return min(positions, max_seq_length(metadata_dir(source)) or positions)


def encoder_config(config: EngineConfig, context: int) -> EngineConfig:
    """An encoder's config: the context served (`context`: `encoder_context`, or --max-model-len where shorter)
    in one step, so --max-num-batched-tokens raised to it where it is shorter (as vLLM does without chunked
    prefill: a top token bucket of that size); as many KV pages as two steps' prompts take (one planned while
    the last is in flight), unless --num-kv-pages says otherwise; no prefix caching (a token's state depends
    on the tokens after it)."""
    sched, cache = config.scheduler, config.cache
    asked = config.model.max_model_len
    served = context if asked in (None, AUTO_MAX_MODEL_LEN) else min(asked, context)
    step_tokens = max(sched.max_num_batched_tokens, served)
    if step_tokens > sched.max_num_batched_tokens:
        logger.info("an encoder reads a prompt whole in one step: --max-num-batched-tokens %d raised to its "
                    "context, %d", sched.max_num_batched_tokens, step_tokens)
    rows = min(sched.max_num_seqs, step_tokens)
    pages = cache.num_kv_pages or 2 * (-(-step_tokens // cache.page_size) + rows) + 1
    buckets = config.buckets
    buckets = dataclasses.replace(buckets, token_buckets=extend_ladder(buckets.token_buckets, step_tokens),
                                  request_buckets=extend_ladder(buckets.request_buckets, rows))
    return dataclasses.replace(config, model=dataclasses.replace(config.model, max_model_len=served),
                               scheduler=dataclasses.replace(sched, max_num_batched_tokens=step_tokens),
                               buckets=buckets,
                               cache=dataclasses.replace(cache, num_kv_pages=pages, enable_prefix_caching=False))
