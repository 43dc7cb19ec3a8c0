"""How an engine serves a model once it is read: generation or pooling (`--runner auto`), how a pooled prompt's
hidden states become its vector (`--pooling-type auto`), and what an encoder (`models.bert`) changes: its
prompts whole in one step, so no longer than a step's tokens, and a KV cache of only the pages its steps in
flight take (its layers keep nothing in them).
"""

import dataclasses
import logging

from jaxserve.config import AUTO_MAX_MODEL_LEN, EngineConfig
from jaxserve.models import is_encoder
from jaxserve.models.classifier import num_classes
from jaxserve.models.loader import LoadedModel
from jaxserve.models.pooling_config import max_seq_length, pooling_type
from jaxserve.models.source import metadata_dir

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
        return resolved
    if first_only and asked != "cls":
        raise ValueError(f"--pooling-type {asked}: the model's classifier head reads its first token's state "
                         "(--pooling-type cls, or auto)")
    return asked


def encoder_config(config: EngineConfig, model: LoadedModel) -> EngineConfig:
    """An encoder's config: the context served cut to what one step takes (--max-num-batched-tokens; an
    explicit --max-model-len longer than that is refused) and to the model's sentence-transformers
    `max_seq_length`; as many KV pages as two steps' prompts take (one planned while the last is in flight),
    unless --num-kv-pages says otherwise; no prefix caching (a token's state depends on the tokens after it)."""
    sched, cache = config.scheduler, config.cache
    step_tokens = sched.max_num_batched_tokens
    asked = config.model.max_model_len
    if asked not in (None, AUTO_MAX_MODEL_LEN) and asked > step_tokens:
        raise ValueError(f"--max-model-len {asked}: an encoder reads a prompt whole in one step, of at most "
                         f"--max-num-batched-tokens {step_tokens} tokens; raise that, or serve a shorter context")
    context = model.max_position_embeddings
    context = min(context, max_seq_length(metadata_dir(model.source)) or context)
    served = min(context, step_tokens) if asked in (None, AUTO_MAX_MODEL_LEN) else min(asked, context)
    if served < context and asked in (None, AUTO_MAX_MODEL_LEN):
        logger.warning("an encoder reads a prompt whole in one step: serving %d tokens of its %d-token context "
                       "(--max-num-batched-tokens serves more)", served, context)
    rows = min(sched.max_num_seqs, step_tokens)
    pages = cache.num_kv_pages or 2 * (-(-step_tokens // cache.page_size) + rows) + 1
    return dataclasses.replace(config, model=dataclasses.replace(config.model, max_model_len=served),
                               cache=dataclasses.replace(cache, num_kv_pages=pages, enable_prefix_caching=False))
