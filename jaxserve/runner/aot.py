"""Ahead-of-time compilation of the step: for a bucket, from shapes alone, for any device.

The step's arguments are described as `jax.ShapeDtypeStruct`s placed on the target device (a local one,
or a deviceless GPU from `jaxserve.device.deviceless_device`), so a compile needs no weights and no
memory on the target. `ModelRunner` uses the same arguments to size its KV cache from the step's peak
temp memory; `jaxserve compile` uses them to compile a whole ladder for a GPU it does not have.
"""

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxserve.models import values_are_keys
from jaxserve.models.features import FeaturePages
from jaxserve.models.layers import KVCache, kv_cache_layers
from jaxserve.ops.attention import kv_cache_shape
from jaxserve.ops.kv_write import padding_slot
from jaxserve.parallel import bytes_per_device, on_one_device, page_array_sharding, replicated
from jaxserve.runner.buckets import Bucket
from jaxserve.runner.kv_sizing import MOE_ROW_COPIES, shapes_estimate
from jaxserve.runner.launches import StepLaunches, compile_with_launches
from jaxserve.runner.packing import neutral_batch, pack
from jaxserve.runner.penalties import PenaltyTables
from jaxserve.runner.step_batch import BatchLayout


@dataclass(frozen=True)
class StepShapes:
    """The facts besides the bucket that fix the step's argument shapes."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_pages: int
    layout: BatchLayout
    dtype: Any  # the KV cache's dtype
    values_are_keys: bool = False  # the cache keeps K alone (`models.values_are_keys`)
    features: FeaturePages | None = None  # the cache ends with hidden states' pages (`models/features.py`)


@dataclass(frozen=True)
class CompiledBucket:
    bucket: Bucket
    compile_seconds: float
    argument_bytes: int
    output_bytes: int
    alias_bytes: int  # outputs that reuse donated arguments (the KV pages, the penalty tables)
    temp_bytes: int  # XLA's scratch for the step: what the KV budget must leave free
    compiled: Any  # jax.stages.Compiled
    launches: StepLaunches | None = None  # when asked for, on a GPU
    origin: str | None = None  # where its executable came from (`compile_origin`), where the caller counted


def step_shapes(
    cfg: Any, dtype: Any, page_size: int, num_pages: int, max_pages_per_req: int, max_num_seqs: int,
    max_drafts: int = 0, features: FeaturePages | None = None,
) -> StepShapes:
    """The step's shapes for a model config (`cfg`: the model file's own) and a KV cache of `num_pages`;
    `max_drafts`: a speculative decode's drafts per request at most (0: none); `features`: the pages of
    hidden states that the cache ends with, if any."""
    layout = BatchLayout(
        page_size=page_size,
        max_pages_per_req=max_pages_per_req,
        padding_slot=padding_slot(num_pages, page_size),
        vocab_size=cfg.vocab_size,
        num_penalty_slots=max_num_seqs,
        max_num_seqs=max_num_seqs,
        max_drafts=max_drafts,
    )
    return StepShapes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_pages, layout, dtype, values_are_keys(cfg),
                      features)


def abstract_weights(state: nnx.State, device: Any, mesh: Mesh | None = None) -> list[jax.ShapeDtypeStruct]:
    """The step's first argument, the leaves of `state` (arrays, or ShapeDtypeStructs of weights still
    loading), as ShapeDtypeStructs where the weights live: on `device`, or as sharded over `mesh`."""
    one_device = on_one_device(device)
    return [jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=x.sharding if mesh is not None else one_device)
            for x in jax.tree.leaves(state)]


def temp_estimate(cfg: Any, weights: list[Any], largest: list[Bucket]) -> int:
    """The KV sizing's first figure for one device's step temp memory (`kv_sizing.shapes_estimate`) from the
    model's config, its weights (arrays or ShapeDtypeStructs; the widest activation is the largest of their
    last two dimensions, one device's share where they are sharded, but for the vocab's weights: the
    embeddings and the head, whose logits the sampler's term counts) and the largest buckets."""

    def one_device(w: Any) -> tuple[int, ...]:
        sharding = getattr(w, "sharding", None)
        return tuple(sharding.shard_shape(w.shape)) if sharding is not None else np.shape(w)

    widest = max((d for w in weights if np.ndim(w) >= 2 and cfg.vocab_size not in np.shape(w)
                  for d in one_device(w)[-2:]), default=0)
    moe = getattr(cfg, "moe", None)
    token_rows = max(b.num_tokens for b in largest) * (moe.top_k * MOE_ROW_COPIES if moe is not None else 1)
    return shapes_estimate(max(b.num_reqs for b in largest), cfg.vocab_size, token_rows, widest)


def abstract_kv_caches(shapes: StepShapes, device: Any, mesh: Mesh | None = None) -> KVCache:
    """The KV cache as ShapeDtypeStructs where the runner keeps it: on `device`, or split by KV head over
    `mesh`."""
    def placed(shape: tuple[int, ...]) -> Any:
        return on_one_device(device) if mesh is None else page_array_sharding(mesh, shape)

    page_shape = kv_cache_shape(shapes.num_pages, shapes.layout.page_size, shapes.num_kv_heads, shapes.head_dim)
    page = jax.ShapeDtypeStruct(page_shape, shapes.dtype, sharding=placed(page_shape))
    caches = kv_cache_layers(shapes.num_layers, shapes.values_are_keys, lambda: page)
    if shapes.features is not None:
        features = shapes.features.shape(shapes.num_pages, shapes.layout.page_size)
        caches.append((jax.ShapeDtypeStruct(features, shapes.features.dtype, sharding=placed(features)), None))
    return caches


def page_bytes_on_device(shapes: StepShapes, device: Any, mesh: Mesh | None = None) -> int:
    """One device's share of one page of the KV cache `shapes` describes (every layer's K/V, and the hidden
    states it keeps): the page arrays whole on `device`, or their shards as the runner splits them over `mesh`
    (`page_array_sharding`: K/V by KV head, hidden states along their width where it divides, else whole on
    every device)."""
    one_page = dataclasses.replace(shapes, num_pages=1)
    return bytes_per_device(jax.tree.leaves(abstract_kv_caches(one_page, device, mesh)))


def abstract_step_args(
    state: nnx.State, shapes: StepShapes, bucket: Bucket, device: Any, mesh: Mesh | None = None,
    multi_step: bool = False,
) -> tuple[Any, ...]:
    """(weights, kv_caches, penalty_tables, batch) as ShapeDtypeStructs on `device` (weights: the leaves of
    `state`, as the step takes them), or with a tensor-parallel
    `mesh` where the runner keeps them: the state as its leaves are sharded, KV pages split by KV head,
    the rest replicated; `multi_step`: and a multi-step decode's steps per row.

    Every compile of a step takes these, never the runner's arrays: an array's placement is part of the
    lowering (one jax made itself is uncommitted, one a step returned is committed to its device), and so
    of the persistent cache's key, which then depended on whether a step had run before the compile."""
    on_device = _placed(device, mesh)
    batch = pack(neutral_batch(bucket, shapes.layout), bucket, shapes.layout)  # numpy: the bucket's shapes
    args = (
        abstract_weights(state, device, mesh),
        abstract_kv_caches(shapes, device, mesh),
        _abstract_penalty_tables(shapes, on_device),
        jax.tree.map(on_device, batch),
    )
    if multi_step:
        args += (on_device(np.zeros(bucket.num_reqs, np.int32)),)
    return args


def abstract_sample_args(shapes: StepShapes, num_reqs: int, device: Any, mesh: Mesh | None = None) -> tuple[Any, ...]:
    """(logits, sampling, penalty_tables) of a request bucket of `num_reqs` rows as ShapeDtypeStructs where
    the step leaves them (on `device`, or replicated over `mesh`): what `step_fn.make_sample_fn`'s program
    takes, for any bucket of as many rows."""
    on_device = _placed(device, mesh)
    sampling = neutral_batch(Bucket(num_reqs, num_reqs, decode_only=True), shapes.layout).sampling  # numpy
    logits = jax.ShapeDtypeStruct((num_reqs, shapes.layout.vocab_size), np.float32)
    return on_device(logits), jax.tree.map(on_device, sampling), _abstract_penalty_tables(shapes, on_device)


def _placed(device: Any, mesh: Mesh | None) -> Callable[[Any], jax.ShapeDtypeStruct]:
    """An array's (or ShapeDtypeStruct's) shape and dtype on `device`, or replicated over `mesh`."""
    sharding = on_one_device(device) if mesh is None else replicated(mesh)
    return lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)


def _abstract_penalty_tables(shapes: StepShapes, on_device: Callable[[Any], jax.ShapeDtypeStruct]) -> PenaltyTables:
    tables = jax.eval_shape(lambda: PenaltyTables.zeros(shapes.layout.num_penalty_slots, shapes.layout.vocab_size))
    return jax.tree.map(on_device, tables)


# XLA's option that forms command buffers (CUDA graphs): none, with vLLM's --enforce-eager.
_NO_COMMAND_BUFFERS = {"xla_gpu_enable_command_buffer": ""}


def step_compiler_options(enforce_eager: bool, platform: str) -> dict[str, Any]:
    """XLA's options for the step's programs (`step_fn`'s makers) on `platform` (a jax device's): with
    `enforce_eager`, no command buffers on a GPU, so that the host launches each kernel of a step, as vLLM
    runs without CUDA graphs. A CPU has none to turn off."""
    return dict(_NO_COMMAND_BUFFERS) if enforce_eager and platform in ("gpu", "cuda", "rocm") else {}


# Held while a step is traced and lowered, by every compile of one (here and the runner's warm-up). That is
# Python, holding the GIL, where XLA's compile releases it: one thread traces at a time, so that a dozen
# compile threads (a GPU machine's cores) leave the GIL to the steps being served rather than take it in
# turns, run their XLA compiles side by side, and each trace's wall-clock span (what `trace_time` sums) is
# its own work, not its wait for another's.
TRACING = threading.Lock()


def compile_bucket(
    step_fn: Any, state: nnx.State, shapes: StepShapes, bucket: Bucket, device: Any, mesh: Mesh | None = None,
    read_launches: bool = False, multi_step: bool = False, compiler_options: dict[str, Any] | None = None,
) -> CompiledBucket:
    """Compiles the jitted step for one bucket on `device` (or `mesh`); raises what XLA, Triton or ptxas
    raise. With a mesh, the memory figures are one device's. `read_launches`: also what the step launches
    (`launches.py`: XLA dumps its thunks for it; GPUs only). `multi_step`: `step_fn` is a multi-step
    decode (`step_fn.make_decode_steps_fn`), which also takes the steps per row. `compiler_options`: XLA's
    (debug options by name), for this compile only."""
    args = abstract_step_args(state, shapes, bucket, device, mesh, multi_step)
    start = time.perf_counter()
    # Pallas's Triton lowering takes the GPU it lowers for from jax's default device (jax >= 0.11; 0.10
    # assumed compute capability 9.0 without a local GPU): the target's, for a deviceless compile.
    with TRACING, jax.default_device(device):
        lowered = step_fn.trace(*args).lower()
    launches = None
    if read_launches:
        compiled, launches = compile_with_launches(
            lambda options: lowered.compile(compiler_options={**(compiler_options or {}), **options}))
    else:
        compiled = lowered.compile(compiler_options=compiler_options or None)
    return _compiled_bucket(bucket, compiled, time.perf_counter() - start, launches)


def compile_sampler(sample_fn: Any, shapes: StepShapes, num_reqs: int, device: Any,
                    mesh: Mesh | None = None) -> CompiledBucket:
    """Compiles `step_fn.make_sample_fn`'s program for a request bucket of `num_reqs` rows on `device` (or
    `mesh`): what a CPU runs beside each plain step (`step_fn.samples_apart`)."""
    args = abstract_sample_args(shapes, num_reqs, device, mesh)
    start = time.perf_counter()
    compiled = sample_fn.trace(*args).lower().compile()
    return _compiled_bucket(Bucket(num_reqs, num_reqs, decode_only=True), compiled, time.perf_counter() - start)


def _compiled_bucket(bucket: Bucket, compiled: Any, seconds: float, launches: StepLaunches | None = None,
                     ) -> CompiledBucket:
    memory = compiled.memory_analysis()
    return CompiledBucket(
        bucket=bucket,
        compile_seconds=seconds,
        argument_bytes=int(memory.argument_size_in_bytes),
        output_bytes=int(memory.output_size_in_bytes),
        alias_bytes=int(memory.alias_size_in_bytes),
        temp_bytes=int(memory.temp_size_in_bytes),
        compiled=compiled,
        launches=launches,
    )
