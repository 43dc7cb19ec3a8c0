"""The jitted step functions: one step over a packed batch (the full sampler or its greedy variant), and a
multi-step decode that runs k decode steps in one call, feeding each step's samples to the next on the
device (vLLM's former multi-step scheduling; `Scheduler` plans it).

Both take the model's weights as a flat list (the leaves of an `nnx.State` with `state_treedef`): JAX
flattens a call's arguments on every call, and flattening the 272-leaf State of SmolLM2 costs 0.36 ms per
step, the list 15 us. With a tensor-parallel `mesh`, logits are gathered whole before sampling and the KV
pages stay split by KV head from step to step. Besides the sampler's output they return the samples by
row, i32[M], which the next step may read as inputs before the host has seen them (on CPUs the plain
step's sampler returns both, below). The batch comes packed
(`packing.pack`): two buffers instead of 25 narrow arrays.

On CPUs the plain step leaves the full sampler to a program of its own (`make_sample_fn`), compiled once
per request bucket rather than once per bucket: most of a step's compile is the sampler's (its top-k and
top-p bisections, the draw, the logprobs), and one bucket's sampler is every bucket's with as many rows.
A CPU runs programs one after another with nothing to launch, so the split costs a dispatch. GPUs keep the
sampler inside the step, one program to launch (the greedy and multi-step variants keep it everywhere).
"""

import dataclasses
import functools
import inspect
import threading
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxserve.models.features import read_features, write_features
from jaxserve.models.layers import KVCache
from jaxserve.ops.attention import trace_environment
from jaxserve.parallel import constrain_pages, replicated
from jaxserve.runner.packing import PackedBatch, unpack
from jaxserve.runner.penalties import PenaltyTables, count_accepted_drafts, count_outputs, update_tables
from jaxserve.runner.prompt_logprobs import no_prompt_logprobs, prompt_logprobs
from jaxserve.runner.sampler import SamplerOutput, no_logprobs, sample, sample_greedy
from jaxserve.runner.step_batch import SamplingArrays, StepBatch


def _shared(maker: Callable) -> Callable:
    """`maker`, made once per distinct arguments while some runner holds its function: runners made alike
    (an `LLM` made again in a notebook cell while the last one still stands, a test module's engines) share
    its jitted function, and with it JAX's caches of its traces, lowerings and executables, so the second
    runner's warm-up traces and compiles nothing. The key is the maker's arguments (the model's GraphDef
    holds its config) and the environment that the model's code reads while tracing (`trace_environment`);
    JAX's caches key the rest (shapes, shardings, its config). Functions are held weakly: once no runner
    holds one, it goes with what JAX keeps for it (a closed engine's executables are not kept for a runner
    that may never come). Arguments that cannot be hashed make a function of their own."""
    signature = inspect.signature(maker)
    made: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
    lock = threading.Lock()

    @functools.wraps(maker)
    def shared(*args: Any, **kwargs: Any) -> Callable:
        arguments = signature.bind(*args, **kwargs).arguments
        options = arguments.pop("compiler_options", None) or {}
        key = (tuple(arguments.items()), tuple(sorted(options.items())), trace_environment())
        try:
            hash(key)
        except TypeError:
            return maker(*args, **kwargs)
        with lock:
            function = made.get(key)
            if function is None:
                function = made[key] = maker(*args, **kwargs)
        return function

    return shared


def _input_ids(batch: StepBatch) -> jax.Array:  # i32[T]
    """The step's tokens, each pending one (async scheduling) taken from the previous step's samples."""
    max_rows = batch.previous_tokens.shape[0]
    return jnp.where(batch.input_from_row < max_rows,
                     batch.previous_tokens.at[batch.input_from_row].get(mode="clip"), batch.input_ids)


def _hidden(model: nnx.Module, batch: StepBatch, input_ids: jax.Array, kv_caches: KVCache,
            feature_layers: tuple[int, ...] | None = None) -> tuple[jax.Array, KVCache]:
    """The model's stack over the batch: (final hidden states [T, D], the KV pages). `feature_layers`: the
    cache's last entry keeps each token's features for an EAGLE drafter (`models/features.py`): its final
    hidden state where empty (EAGLE's), the inputs of those layers side by side where given (EAGLE-3's)."""
    if feature_layers is not None:
        (features, _), kv_caches = kv_caches[-1], kv_caches[:-1]
    lora_slots = batch.lora_slots if getattr(model.cfg, "lora", None) is not None else None  # each token's slot
    if feature_layers:
        hidden, kv_caches, kept = model.hidden_and_layer_inputs(input_ids, batch.positions, kv_caches,
                                                                batch.attention, feature_layers, lora_slots)
    else:
        lora = () if lora_slots is None else (lora_slots,)
        hidden, kv_caches = model(input_ids, batch.positions, kv_caches, batch.attention, *lora)
        kept = hidden
    if feature_layers is not None:
        kv_caches = [*kv_caches, (write_features(features, kept, batch.attention.slot_mapping), None)]
    return hidden, kv_caches


def _forward(model: nnx.Module, batch: StepBatch, input_ids: jax.Array, kv_caches: KVCache,
             mesh: Mesh | None, feature_layers: tuple[int, ...] | None = None) -> tuple[jax.Array, jax.Array, KVCache]:
    """The model over the batch: (hidden f32[T, D], the sampled rows' logits f32[R, V], the KV pages)."""
    hidden, kv_caches = _hidden(model, batch, input_ids, kv_caches, feature_layers)
    logits = model.compute_logits(hidden[batch.logits_indices])  # f32[R, V]
    if mesh is not None:
        logits = jax.lax.with_sharding_constraint(logits, replicated(mesh))
        kv_caches = constrain_pages(kv_caches, mesh)
    return hidden, logits, kv_caches


def _by_row(tokens: jax.Array, max_rows: int, mesh: Mesh | None) -> jax.Array:  # i32[M]
    """The samples, i32[R], as the next step reads them: by row, over all M rows."""
    tokens_by_row = jnp.zeros(max_rows, jnp.int32).at[: tokens.shape[0]].set(tokens)
    return tokens_by_row if mesh is None else jax.lax.with_sharding_constraint(tokens_by_row, replicated(mesh))


def _pooled(model: nnx.Module, hidden: jax.Array, batch: StepBatch) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each row's final hidden state at its first and its last token this step (f32[R, D] each) and summed over
    its tokens this step (f32[R, D]; padding tokens, past `cu_q_lens[-1]`, fall outside every row and are
    dropped); a classifier's through its head (`pool_head`: f32[R, L] each)."""
    cu_q_lens = batch.attention.cu_q_lens  # i32[R+1]
    num_rows = batch.logits_indices.shape[0]
    token_rows = jnp.searchsorted(cu_q_lens, jnp.arange(hidden.shape[0]), side="right") - 1  # i32[T]
    hidden = hidden.astype(jnp.float32)
    first = hidden[jnp.clip(cu_q_lens[:-1], 0, hidden.shape[0] - 1)]
    last, total = hidden[batch.logits_indices], jax.ops.segment_sum(hidden, token_rows, num_segments=num_rows)
    head = getattr(model, "pool_head", None)
    return (first, last, total) if head is None else (head(first), head(last), head(total))


@_shared
def make_step_fn(graphdef: nnx.GraphDef, state_treedef: Any, num_top_logprobs: int, mesh: Mesh | None = None,
                 greedy: bool = False, pooling: bool = False, sample_apart: bool = False,
                 compiler_options: dict[str, Any] | None = None, *, feature_layers: tuple[int, ...] | None = None):
    """`step(weights, kv_caches, penalty_tables, packed) -> (kv_caches, penalty_tables, SamplerOutput,
    PromptLogprobs, tokens_by_row)` (with `sample_apart`, below, the logits in the sampler's place), jitted
    with the KV pages and penalty tables donated.
    `greedy`: the variant for batches whose every row is greedy and asks for nothing more
    (`sampler.sample_greedy`): no penalty update, no prompt logprobs, no control flow around them.
    `sample_apart` (CPUs, not with `greedy` or `pooling`): the step stops at the logits and returns (kv_caches,
    penalty_tables, logits f32[R, V], SamplingArrays, PromptLogprobs) for `make_sample_fn`'s program.
    `pooling` (--runner pooling): each row's pooled hidden states (`_pooled`), last in the tuple, and no logits:
    a pooled request's one sample is dropped, so none is drawn (token 0, no logprobs; the tables untouched).
    Drawing it from [R, V] logits cost an XLM-R reranker (250,002 tokens) 1.9 ms a prompt on a CPU.
    `feature_layers`: the KV cache ends with the pages of each token's features for an EAGLE drafter (`_hidden`).
    `compiler_options`: XLA's, for every compile of it (`step_compiler_options`), as for the makers below."""

    if pooling and (greedy or sample_apart):
        raise ValueError("a pooling step draws no sample: no greedy or sampler variant of it")

    def pool(weights: list[jax.Array], kv_caches: KVCache, penalty_tables: PenaltyTables, packed: PackedBatch):
        model = nnx.merge(graphdef, jax.tree.unflatten(state_treedef, weights))
        batch = unpack(packed)
        hidden, kv_caches = _hidden(model, batch, _input_ids(batch), kv_caches)
        if mesh is not None:  # the pages stay split by KV head, as `_forward` keeps them
            kv_caches = constrain_pages(kv_caches, mesh)
        num_rows = batch.logits_indices.shape[0]
        sampled = SamplerOutput(jnp.zeros(num_rows, jnp.int32), *no_logprobs(num_rows, num_top_logprobs))
        return (kv_caches, penalty_tables, sampled, no_prompt_logprobs(hidden.shape[0], num_top_logprobs),
                _by_row(sampled.tokens, batch.previous_tokens.shape[0], mesh), _pooled(model, hidden, batch))

    def step(weights: list[jax.Array], kv_caches: KVCache, penalty_tables: PenaltyTables, packed: PackedBatch):
        model = nnx.merge(graphdef, jax.tree.unflatten(state_treedef, weights))
        batch = unpack(packed)
        input_ids = _input_ids(batch)
        hidden, logits, kv_caches = _forward(model, batch, input_ids, kv_caches, mesh, feature_layers)
        if greedy:
            sampled = sample_greedy(logits, num_top_logprobs)
            prompt = no_prompt_logprobs(hidden.shape[0], num_top_logprobs)
        else:
            on_cuda = model.cfg.attention.cuda  # the target's, deviceless too
            penalty_tables = update_tables(penalty_tables, input_ids, batch.penalty_updates,
                                           skip_untouched=not on_cuda)
            if mesh is not None:
                penalty_tables = jax.lax.with_sharding_constraint(penalty_tables, replicated(mesh))
            prompt = prompt_logprobs(model.compute_logits, hidden, batch.prompt_logprob_targets, logits.shape[-1],
                                     num_top_logprobs, on_cuda)
            if not sample_apart:
                sampled = sample(logits, batch.sampling, penalty_tables, num_top_logprobs, on_cuda)
                penalty_tables = _count_accepted_drafts(penalty_tables, batch.sampling, sampled, mesh, on_cuda)
        if sample_apart and not greedy:  # `make_sample_fn`'s program samples
            sampling = batch.sampling if mesh is None else jax.lax.with_sharding_constraint(batch.sampling,
                                                                                            replicated(mesh))
            outputs = (kv_caches, penalty_tables, logits, sampling, prompt)
        else:
            outputs = (kv_caches, penalty_tables, sampled, prompt,
                       _by_row(sampled.tokens, batch.previous_tokens.shape[0], mesh))
        return outputs

    return jax.jit(pool if pooling else step, donate_argnames=("kv_caches", "penalty_tables"),
                   compiler_options=compiler_options or None)


def _count_accepted_drafts(tables: PenaltyTables, sampling: SamplingArrays, sampled: SamplerOutput,
                           mesh: Mesh | None, on_cuda: bool) -> PenaltyTables:
    """The penalty tables once a speculative decode's accepted drafts are counted (`penalties`' docstring)."""
    tables = count_accepted_drafts(tables, sampling.penalty_drafts, sampled.tokens, sampling.penalty_slots,
                                   skip_untouched=not on_cuda)
    return tables if mesh is None else jax.lax.with_sharding_constraint(tables, replicated(mesh))


def samples_apart(platform: str) -> bool:
    """Whether a runner on `platform` leaves the plain step's sampler to `make_sample_fn`'s program: on CPUs
    (the module's docstring)."""
    return platform == "cpu"


@_shared
def make_sample_fn(num_top_logprobs: int, max_rows: int, mesh: Mesh | None = None,
                   compiler_options: dict[str, Any] | None = None):
    """`sample_step(logits, sampling, penalty_tables) -> (SamplerOutput, tokens_by_row i32[M], penalty_tables)`,
    jitted: the full sampler of a step made with `sample_apart` (CPUs), as its own program; its shapes are
    the request bucket's alone (logits f32[R, V], SamplingArrays of R rows). `max_rows`: M, the runner's
    rows. The penalty tables pass through donated, so the next step's donation of them follows this program
    rather than a pending read of it."""

    def sample_step(logits: jax.Array, sampling: SamplingArrays, penalty_tables: PenaltyTables):
        sampled = sample(logits, sampling, penalty_tables, num_top_logprobs)
        penalty_tables = _count_accepted_drafts(penalty_tables, sampling, sampled, mesh, on_cuda=False)
        return sampled, _by_row(sampled.tokens, max_rows, mesh), penalty_tables

    return jax.jit(sample_step, donate_argnames=("penalty_tables",), compiler_options=compiler_options or None)


@_shared
def make_decode_steps_fn(graphdef: nnx.GraphDef, state_treedef: Any, num_top_logprobs: int, num_steps: int,
                         page_size: int, padding_slot: int, mesh: Mesh | None = None, greedy: bool = False,
                         compiler_options: dict[str, Any] | None = None, *,
                         feature_layers: tuple[int, ...] | None = None):
    """`decode_steps(weights, kv_caches, penalty_tables, packed, row_steps) -> (kv_caches, penalty_tables,
    SamplerOutput with tokens, logprobs and ranks [num_steps, R], tokens_by_row)`, for a decode-only batch (row r's
    one token at index r) whose rows need nothing from the host between steps (no grammar, no bans, no top
    logprobs: the scheduler plans such decodes only, `Request.decodes_on_device`). A row's logit_bias and
    allowed tokens hold for every step; its penalty row counts each step's input token as generated, as a
    single step's would (step 0's as the batch says, from the host).

    Step s (a `lax.fori_loop` of `num_steps`) feeds each row step s - 1's sample at the next position,
    writing its K/V through the row's page table, and samples with output index + s (a seed's draws
    are the single steps'). A row runs its own `row_steps` (i32[R]; 0 for padding): past them it repeats
    its last step with its K/V write dropped, and its samples are padding."""

    def decode_steps(weights: list[jax.Array], kv_caches: KVCache, penalty_tables: PenaltyTables,
                     packed: PackedBatch, row_steps: jax.Array):
        model = nnx.merge(graphdef, jax.tree.unflatten(state_treedef, weights))
        batch = unpack(packed)
        attention = batch.attention
        # a k-step plan carries no drafts: its rows' draft columns (padding) are left out of the penalties
        sampling = dataclasses.replace(batch.sampling, penalty_drafts=batch.sampling.penalty_drafts[:, :0])
        num_rows = batch.logits_indices.shape[0]
        last_step = jnp.maximum(row_steps - 1, 0)  # i32[R]
        on_cuda = model.cfg.attention.cuda  # the target's, deviceless too
        num_slots = penalty_tables.output_counts.shape[0]
        input_ids = _input_ids(batch)
        if not greedy:  # (the greedy variant's rows have no penalty row)
            penalty_tables = update_tables(penalty_tables, input_ids, batch.penalty_updates,
                                           skip_untouched=not on_cuda)
            if mesh is not None:
                penalty_tables = jax.lax.with_sharding_constraint(penalty_tables, replicated(mesh))

        def one_step(step: jax.Array, carry: tuple) -> tuple:
            kv_caches, penalty_tables, input_ids, tokens, logprobs, ranks = carry
            offset = jnp.minimum(step, last_step)  # i32[R]: a row past its steps stays on its last
            positions = batch.positions + offset  # i32[R] (T == R)
            pages = attention.page_table[jnp.arange(num_rows), positions // page_size]  # i32[R]
            slots = jnp.where(step < row_steps, pages * page_size + positions % page_size, padding_slot)
            moved = dataclasses.replace(
                batch, positions=positions,
                attention=dataclasses.replace(attention, slot_mapping=slots, kv_lens=attention.kv_lens + offset),
            )
            _, logits, kv_caches = _forward(model, moved, input_ids, kv_caches, mesh, feature_layers)
            if greedy:
                sampled = sample_greedy(logits, num_top_logprobs)
            else:
                # the last step's samples are this step's inputs: generated tokens of the rows that ran it
                counted = jnp.where((step > 0) & (step < row_steps), sampling.penalty_slots, num_slots)  # i32[R]
                penalty_tables = count_outputs(penalty_tables, input_ids, counted, skip_untouched=not on_cuda)
                moved_sampling = dataclasses.replace(sampling, output_index=sampling.output_index + offset)
                sampled = sample(logits, moved_sampling, penalty_tables, num_top_logprobs, on_cuda=on_cuda)
            return (kv_caches, penalty_tables, sampled.tokens, tokens.at[step].set(sampled.tokens),
                    logprobs.at[step].set(sampled.logprobs), ranks.at[step].set(sampled.ranks))

        carry = (kv_caches, penalty_tables, input_ids, jnp.zeros((num_steps, num_rows), jnp.int32),
                 jnp.zeros((num_steps, num_rows), jnp.float32), jnp.zeros((num_steps, num_rows), jnp.int32))
        # A row's last sample feeds the next call (async k-step calls). For a row with fewer steps than k it
        # is a padding step's, not its own: such a row reaches its max_tokens, and is never planned again.
        kv_caches, penalty_tables, last_tokens, tokens, logprobs, ranks = jax.lax.fori_loop(
            0, num_steps, one_step, carry)
        no_top = jnp.zeros((num_steps, num_rows, num_top_logprobs), jnp.int32)
        sampled = SamplerOutput(tokens, logprobs, ranks, no_top, no_top.astype(jnp.float32))
        return kv_caches, penalty_tables, sampled, _by_row(last_tokens, batch.previous_tokens.shape[0], mesh)

    return jax.jit(decode_steps, donate_argnames=("kv_caches", "penalty_tables"),
                   compiler_options=compiler_options or None)


@_shared
def make_feature_copy_fn(graphdef: nnx.GraphDef, state_treedef: Any, mesh: Mesh | None = None,
                         compiler_options: dict[str, Any] | None = None):
    """`copy(weights, target_pages, drafter_pages, source_slots, dest_slots) -> drafter_pages`, jitted with the
    drafter's pages donated: an EAGLE drafter's cache (`models/features.py`) given the target's features at
    `source_slots` (i32[N]) at `dest_slots` (i32[N]; past its cache for padding), through the drafter's
    `project_features` where it has one (EAGLE-3's `fc`). `graphdef` and `state_treedef`: the drafter's; with a
    `mesh`, the pages stay where the drafter's steps take them (`parallel.page_array_sharding`)."""

    def copy(weights: list[jax.Array], target_pages: jax.Array, drafter_pages: jax.Array, source_slots: jax.Array,
             dest_slots: jax.Array) -> jax.Array:
        model = nnx.merge(graphdef, jax.tree.unflatten(state_treedef, weights))
        features = read_features(target_pages, source_slots)  # [N, F]
        project = getattr(model, "project_features", None)
        features = features if project is None else project(features)
        written = write_features(drafter_pages, features.astype(drafter_pages.dtype), dest_slots)
        return written if mesh is None else constrain_pages(written, mesh)

    return jax.jit(copy, donate_argnames=("drafter_pages",), compiler_options=compiler_options or None)
