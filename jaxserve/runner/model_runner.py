"""ModelRunner: owns the weights, the KV pages and the jitted step; turns a SchedulerOutput into tokens.

The step is one pure function,
`step(state, kv_caches, penalty_tables, batch) -> (kv_caches, penalty_tables, SamplerOutput)`,
jitted once with the KV pages and penalty tables donated (updated in place) and compiled ahead of time
for every bucket at warm-up, a few buckets at once on worker threads; steps run those executables. On
CPUs the plain step is two programs, the step to the logits and the sampler, compiled once per request
bucket with the first bucket of its size (`step_fn.samples_apart`).
A background warm-up (`serve --warmup background`) makes the runner ready after one bucket and compiles the
rest on a thread; the engine thread only reads the table of compiled buckets, under a lock.
Results leave the device once per step. `launch` dispatches a step and returns at once; `collect` waits
for its sampled tokens. With async scheduling the engine launches step N + 1 before collecting step N:
N + 1's decodes read N's samples on the device (`StepBatch.input_from_row`), and XLA runs the two in order,
so a page freed after N was launched is written by N before any later step reuses it.
With a tensor-parallel mesh (`jaxserve.parallel`) the weights, KV pages and step are split over its
devices; in a multi-host job the leader's runner sends each piece of device work to the other processes
(`jaxserve.runner.multihost`) before running it, and their runners replay it.
"""

import dataclasses
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from jaxserve import __version__
from jaxserve.allocator import allocator_note
from jaxserve.background import on_a_thread
from jaxserve.collector import fewer_collections
from jaxserve.config import CacheConfig
from jaxserve.device import allocator_pool_fraction, device_memory_stats
from jaxserve.engine.step_io import NewRequest, RequestFault, SchedulerOutput, StepOutput
from jaxserve.models.features import feature_pages
from jaxserve.models.fp8_layout import kernel_layout
from jaxserve.models.kv_scales import apply_fp8_kv_scales
from jaxserve.models.layers import KVCache
from jaxserve.models.loader import LoadedModel
from jaxserve.models.lora import stack_shapes
from jaxserve.models.peft import LoraAdapter, slot_values
from jaxserve.ops.attention import kv_cache_dtype, trace_environment
from jaxserve.ops.kv_write import padding_slot
from jaxserve.outputs import Logprob
from jaxserve.parallel import bytes_per_device, replicated
from jaxserve.progress import progress
from jaxserve.runner import compile_origin, trace_time
from jaxserve.runner.aot import (
    TRACING,
    CompiledBucket,
    StepShapes,
    abstract_kv_caches,
    abstract_sample_args,
    abstract_step_args,
    abstract_weights,
    compile_bucket,
    page_bytes_on_device,
    step_compiler_options,
    step_shapes,
    temp_estimate,
)
from jaxserve.runner.batch import build_step_batch
from jaxserve.runner.buckets import Bucket, BucketLadder, ExecutedStep, largest_buckets
from jaxserve.runner.kv_budget import KVBudget, budget_from_memory_stats, fit_to_kv_cache, pages_in_host_memory
from jaxserve.runner.kv_sizing import QUICK_ESTIMATE_OPTIONS, SizedKVCache, size_kv_cache
from jaxserve.runner.multihost import Broadcast, LoadSeenTokens, Step
from jaxserve.runner.packing import neutral_batch, pack
from jaxserve.runner.penalties import PenaltyTables, load_row, seen_tokens
from jaxserve.runner.prompt_logprobs import PromptLogprobs
from jaxserve.runner.request_rows import RequestRows
from jaxserve.runner.sampler import SamplerOutput
from jaxserve.runner.step_batch import StepBatch
from jaxserve.runner.step_fn import make_decode_steps_fn, make_sample_fn, make_step_fn, samples_apart
from jaxserve.runner.temp_records import StepTempRecord, TempRecords, fingerprint, source_digest

logger = logging.getLogger(__name__)

# Buckets compiled at once at warm-up, one per core this process may run on (measured 1.5x faster than one
# at a time on a 2-core CPU; a GPU host's 16 cores compiled on 4 threads before). A data-parallel rank on a
# CPU has its share of the cores (`placement`).
_COMPILE_THREADS = len(os.sched_getaffinity(0)) or 1

# Where the KV sizing's first figure came from (`SizedKVCache.source`), as the start's log says it.
_SIZING_SOURCES = {"record": "an earlier start's record", "shapes": "the step's shapes", "compiles": "quick compiles"}

# The environment variables that change what the step compiles to, besides the kernel choices the model's
# code reads as it traces (`trace_environment`): XLA's and a TPU's flags, the native CPU kernels' compiler flags.
_STEP_ENVIRONMENT = ("XLA_FLAGS", "LIBTPU_INIT_ARGS", "JAXSERVE_KERNEL_FLAGS")


@dataclass(frozen=True, order=True)
class StepVariant:
    """Which compiled function runs a step: the full sampler or the greedy one, one step or a multi-step
    decode. Each decode bucket has up to four (the flags turn the others on); mixed buckets only the
    plain one."""

    greedy: bool = False
    multi_step: bool = False


PLAIN = StepVariant()


def to_host(tree: Any) -> Any:
    """Device arrays to numpy (transfers started together); a replicated array that spans other processes'
    devices (multi-host) is read from this process's copy."""
    if all(x.is_fully_addressable for x in jax.tree.leaves(tree)):
        return jax.device_get(tree)
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tree)


@dataclass(frozen=True)
class LaunchedStep:
    """A step dispatched to the device; its results stay there until `ModelRunner.collect`."""

    scheduler_output: SchedulerOutput
    batch: StepBatch  # host numpy: what collect needs to map results back to requests
    row_ids: np.ndarray  # intp[n]: each step row's request row (`RequestRows`)
    num_top_logprobs: np.ndarray  # i32[n]: alternatives each row reports (read at launch: rows are reused)
    num_prompt_logprobs: np.ndarray  # i32[n]: the same per prompt token
    sampled: SamplerOutput  # on the device; a multi-step decode's tokens, logprobs and ranks are [k, R]
    prompt: PromptLogprobs | None  # on the device; None for a multi-step decode
    pooled: tuple[jax.Array, ...] | None = None  # on the device, --runner pooling: f32[R, D] first, last, sum


def _zeroed_kv_caches(abstract: KVCache) -> KVCache:
    """The KV cache `abstract` describes, zeroed, in one program: one dispatch, where a zeros call per page
    array paid one each (and on a CPU took half as long again). A runner made again runs the same program."""
    return list(_zeros_program(tuple(tuple(layer) for layer in abstract))())


@functools.cache
def _zeros_program(abstract: tuple[tuple[jax.ShapeDtypeStruct, ...], ...]) -> Any:
    shardings = jax.tree.map(lambda page: page.sharding, abstract)
    return jax.jit(lambda: jax.tree.map(lambda page: jnp.zeros(page.shape, page.dtype), abstract),
                   out_shardings=shardings)


def _kv_dtype(model: LoadedModel, cache_config: CacheConfig) -> Any:
    """The dtype `model`'s KV cache takes under `cache_config`."""
    cfg = model.cfg
    return kv_cache_dtype(cache_config.kv_cache_dtype, model.dtype, cfg.attention.impl,
                          cfg.attention.compute_capability)


def kv_page_bytes(model: LoadedModel, cache_config: CacheConfig,
                  feature_layers: tuple[int, ...] | None = None) -> int:
    """One device's share of one page of `model`'s KV cache: every layer's K/V at the cache's dtype for it,
    and the hidden states it keeps (`feature_pages`), split as the runner splits them over the model's mesh
    (`aot.page_bytes_on_device`)."""
    shapes = step_shapes(model.cfg, _kv_dtype(model, cache_config), cache_config.page_size, 1, 1, 1, 0,
                         feature_pages(model.cfg, model.dtype, feature_layers))
    return page_bytes_on_device(shapes, jax.devices()[0], model.mesh)


@dataclass(frozen=True)
class DraftShare:
    """What a draft model beside the runner's model takes of the memory its KV cache is sized in (bytes on
    one device): its weights, its runner's state (penalty tables), and its own KV page per page of the
    runner's (the draft's cache holds as many tokens)."""

    weight_bytes: int
    state_bytes: int
    page_bytes: int


class ModelRunner:
    def __init__(
        self,
        model: LoadedModel,
        cache_config: CacheConfig,
        ladder: BucketLadder,
        max_model_len: int,
        max_num_seqs: int,
        max_logprobs: int,
        broadcast: Broadcast | None = None,
        greedy_decodes: bool = False,
        num_decode_steps: int = 1,
        pooling: bool = False,
        temp_records_dir: str | None = None,
        enforce_eager: bool = False,
        fit_to_cache: bool = False,
        max_drafts: int = 0,
        draft: DraftShare | None = None,
        feature_layers: tuple[int, ...] | None = None,
    ) -> None:
        """`fit_to_cache` (--max-model-len auto): `max_model_len` shortened to what the KV cache holds, where
        that is less (`self.max_model_len` is what the runner serves). `max_drafts`: a speculative decode's
        drafts per request at most (0: none), which a penalty row's sampling counts. `draft`: a draft model's
        share of the memory the KV budget divides (`DraftShare`), which the runner then sizes its page count
        for. `feature_layers`: each step keeps its tokens' features for an EAGLE drafter in pages beside their K/V
        (`models/features.py`): their final hidden states (empty), or the inputs of those layers (EAGLE-3)."""
        if pooling and (greedy_decodes or num_decode_steps > 1):
            raise ValueError("a pooling runner runs only its plain step: no greedy or multi-step decodes")
        self.model = model
        # Before the steps take the state's form (weights loading on a thread are never block-scaled FP8 ones)
        if not model.loading and (laid_out := kernel_layout(model.state, model.cfg.attention)):
            logger.info("FP8 block weights: %d stored K-major for Hopper's FP8 wgmma (ops/fp8_block_matmul_mgpu.py)",
                        laid_out)
        self.max_logprobs = max_logprobs
        # Where the KV sizing keeps the step's temp memory for the next start (`temp_records.py`): the
        # persistent compilation cache's directory; None: every start estimates it afresh, as does each
        # process of a multi-host job (their page counts must agree, and their records might not).
        self._temp_records = TempRecords.beside(temp_records_dir) if jax.process_count() == 1 else None
        self.pooling = pooling  # each step also returns the rows' pooled hidden states (`step_fn._pooled`)
        self._compiled: dict[Bucket, Any] = {}  # jax.stages.Compiled per bucket (PLAIN), filled by warmup
        # The decode buckets' other variants: greedy when `greedy_decodes`, multi-step when num_decode_steps > 1.
        self._compiled_variants: dict[tuple[Bucket, StepVariant], Any] = {}
        self.greedy_decodes = greedy_decodes
        self.num_decode_steps = num_decode_steps
        self.num_greedy_steps = 0  # steps run by a greedy variant, for tests and benchmarks
        self.num_multi_steps = 0  # calls of a multi-step variant, the same
        self._compiled_lock = threading.Lock()  # a background warm-up adds while steps read
        # The start's step compiles' tracing and lowering, summed (the KV sizing's and the warm-up's)
        self._warmup_python = trace_time.TraceTime()
        self._stop_compiling = threading.Event()
        self._background: threading.Thread | None = None
        self.last_step: ExecutedStep | None = None  # for benchmarks: the bucket the last step ran in
        self._broadcast = broadcast  # multi-host leader: sends each step's device work to the followers
        self.ladder = ladder
        self.page_size = cache_config.page_size
        self.max_model_len = max_model_len
        self._fit_to_cache = fit_to_cache  # the page tables as wide as the cache holds (`_served_len`)
        self._max_drafts = max_drafts
        self.max_pages_per_req = -(-max_model_len // self.page_size)
        cfg = model.cfg
        self.max_num_seqs = max_num_seqs
        self.kv_dtype = _kv_dtype(model, cache_config)
        page_bytes = kv_page_bytes(model, cache_config, feature_layers)
        self.features = feature_pages(model.cfg, model.dtype, feature_layers)  # the cache's last entry, if any
        self.mesh = model.mesh
        treedef = jax.tree.structure(model.state)
        # CPUs: the plain step's sampler is a program of its own, compiled once per request bucket (`step_fn`).
        self.sample_apart = samples_apart(jax.devices()[0].platform) and not pooling  # (a pooling step draws none)
        # XLA's options for every program of the step (`--enforce-eager`: no CUDA graphs on a GPU)
        self._compiler_options = step_compiler_options(enforce_eager, jax.devices()[0].platform)
        options = self._compiler_options
        self._sample_fn = make_sample_fn(max_logprobs, max_num_seqs, self.mesh, compiler_options=options)
        self._compiled_samplers: dict[int, Any] = {}  # jax.stages.Compiled per request bucket (R), by warmup
        # One lock per R, so that two buckets' compiles on threads compile their sampler once.
        self._sampler_locks = {r: threading.Lock() for r in {b.num_reqs for b in ladder.all_buckets()}}
        self._step_fns = {PLAIN: make_step_fn(model.graphdef, treedef, max_logprobs, self.mesh, pooling=pooling,
                                              sample_apart=self.sample_apart, feature_layers=feature_layers,
                                              compiler_options=options),
                          StepVariant(greedy=True): make_step_fn(model.graphdef, treedef, max_logprobs, self.mesh,
                                                                 greedy=True, feature_layers=feature_layers,
                                                                 compiler_options=options)}
        self._step = self._step_fns[PLAIN]
        if self.kv_dtype.itemsize == 1 and model.kv_scales is None:  # FP8: per-layer scales, in the weights
            model.wait_for_weights()  # (calibrated on them, then folded into them)
            model.kv_scales = apply_fp8_kv_scales(model, self.kv_dtype)
        # The step's first argument as compiles take it (`aot.abstract_step_args` makes it the same way), placed:
        # what the KV budget and its record count, without waiting for weights loading on a thread.
        self._abstract_weights = abstract_weights(model.state, jax.devices()[0], self.mesh)
        # The weights flattened once, the step's first argument; None until weights loading are in.
        self._weights: list[jax.Array] | None = None if model.loading else jax.tree.leaves(model.state)
        self._single_process = jax.process_count() == 1
        # While weights load, the device holds part of them: the KV budget counts them by their shapes, on
        # top of what it held before.
        loading_bytes = (model.in_use_before_loading + bytes_per_device(self._abstract_weights)
                         if model.loading else None)
        if draft is not None:  # loaded after this model's load began: not in its `in_use_before_loading`
            loading_bytes = None if loading_bytes is None else loading_bytes + draft.weight_bytes
        sizing_page_bytes = page_bytes + (draft.page_bytes if draft is not None else 0)
        self._draft_state_bytes = draft.state_bytes if draft is not None else 0  # made after this runner
        self.num_pages, sized = self._num_kv_pages(cache_config, sizing_page_bytes,
                                                   loading_weights_bytes=loading_bytes)
        if (served := self._served_len(self.num_pages)) < max_model_len:  # the sized steps compiled at it too
            logger.info("--max-model-len auto: %d tokens, what the KV cache holds of the model's %d", served,
                        max_model_len)
            self.max_model_len, self.max_pages_per_req = served, -(-served // self.page_size)
        # The largest buckets' plain steps, compiled by the GPU memory budget at the final page count
        # (`kv_sizing.py`): the warm-up takes them instead of compiling them again (a multi-host job's
        # followers compile what the leader sends).
        self._sized_executables: dict[Bucket, CompiledBucket] = sized if self._single_process else {}
        for greedy in (False, True):  # they need the page count: its padding slot
            self._step_fns[StepVariant(greedy, multi_step=True)] = make_decode_steps_fn(
                model.graphdef, treedef, max_logprobs, num_decode_steps, self.page_size,
                padding_slot(self.num_pages, self.page_size), self.mesh, greedy, self._compiler_options,
                feature_layers=feature_layers)
        if jax.default_backend() != "cpu":  # a load's transient buffers must not meet a pool the pages fill
            self.wait_for_weights()
        self._step_shapes = self._shapes(self.num_pages)
        self.layout = self._step_shapes.layout
        # Zeroed where the compiles take the pages (`aot.abstract_step_args`): on the device, or split by KV head.
        # On a CPU, zeroing is the first touch of every page (page faults, not bandwidth): it runs on a thread
        # while the warm-up's first compile traces, and the first step waits for it (`kv_caches`).
        abstract_kv = abstract_kv_caches(self._step_shapes, jax.devices()[0], self.mesh)
        self._kv_caches: KVCache | None = None
        self._kv_zeroing: Future | None = None
        if jax.default_backend() == "cpu":
            self._kv_zeroing = on_a_thread(lambda: _zeroed_kv_caches(abstract_kv), "jaxserve-kv-cache")
        else:
            self._kv_caches = _zeroed_kv_caches(abstract_kv)
        self.rows = RequestRows(max_num_seqs, self.max_pages_per_req, cfg.vocab_size)  # the persistent batch
        self.penalty_tables = PenaltyTables.zeros(max_num_seqs, cfg.vocab_size)
        if self.mesh is not None:
            self.penalty_tables = jax.device_put(to_host(self.penalty_tables), replicated(self.mesh))
        self._load_penalty_row = jax.jit(load_row, donate_argnums=0)
        # The last step's samples by batch row, on the device (async scheduling feeds them to the next step).
        self._previous_tokens = jnp.zeros(max_num_seqs, jnp.int32, device=None if self.mesh is None
                                          else replicated(self.mesh))
        self._device_copies: dict[int, tuple[np.ndarray, jax.Array]] = {}  # see _on_device
        # --enable-lora: the adapters the engine serves (`add_lora`) and the device slots they are written to
        self.lora = LoraWriter(model) if getattr(model.cfg, "lora", None) is not None else None
        logger.info(
            "KV cache: %d pages of %d tokens (%.2f GiB%s, %s)",
            self.num_pages, self.page_size, self.num_pages * page_bytes / 2**30,
            " a device" if self.mesh is not None else "", self.kv_dtype.name,
        )
        if jax.default_backend() == "cpu":  # where the allocator decides a step's speed
            logger.info("%s", allocator_note())

    @property
    def kv_caches(self) -> KVCache:
        """The KV cache: per layer, (keys, values) pages on the device; waits for its zeroing on a thread."""
        if self._kv_caches is None:
            assert self._kv_zeroing is not None
            self._kv_caches = self._kv_zeroing.result()
            self._kv_zeroing = None
        return self._kv_caches

    @kv_caches.setter
    def kv_caches(self, caches: KVCache) -> None:  # each step's, the donated pages' successors
        self._kv_caches = caches

    def wait_for_weights(self) -> list[jax.Array]:
        """The step's weights, once weights loading on a thread are in (at once where they are); raises
        what their load raised. Steps run on one thread at a time, which is the one that calls this."""
        if self._weights is None:
            waited = self.model.wait_for_weights()
            self._weights = jax.tree.leaves(self.model.state)
            logger.info("weights: in; the start waited %.1fs for them", waited)
        return self._weights

    def _served_len(self, num_pages: int) -> int:
        """The longest request at a cache of `num_pages`: max_model_len, or under --max-model-len auto as
        much of it as the cache holds."""
        if not self._fit_to_cache:
            return self.max_model_len
        return fit_to_kv_cache(self.max_model_len, num_pages, self.page_size)

    def _shapes(self, num_pages: int) -> StepShapes:
        pages_per_req = -(-self._served_len(num_pages) // self.page_size)  # the page tables' width
        return step_shapes(self.model.cfg, self.kv_dtype, self.page_size, num_pages, pages_per_req,
                           self.max_num_seqs, self._max_drafts, self.features)

    def _num_kv_pages(self, cache: CacheConfig, page_bytes: int, stats: dict[str, int] | None = None,
                      loading_weights_bytes: int | None = None) -> tuple[int, dict[Bucket, CompiledBucket]]:
        """(the KV cache's page count of `page_bytes`, one device's share of a page, and the largest buckets'
        plain steps compiled at it where sizing it took that): --num-kv-pages; else on CPU --kv-cache-memory
        (the host's memory, which each of its devices' shares takes from); else what --gpu-memory-utilization leaves of
        the device's memory (`stats`: the device's memory_stats(), read here unless given), sized from an
        estimate of the step's temp memory that its compiles check (`kv_sizing.py`).
        `loading_weights_bytes`: one device's share of weights still loading, which the budget counts in
        place of what the device holds so far."""
        if cache.num_kv_pages is not None:
            return cache.num_kv_pages, {}
        device = jax.devices()[0]
        if stats is None:
            stats = device_memory_stats(device)
        if not stats or "bytes_limit" not in stats:
            num_pages = pages_in_host_memory(cache.kv_cache_memory_gib, page_bytes,
                                             len(self.mesh.local_devices) if self.mesh is not None else 1)
            if num_pages < 2:
                raise ValueError(f"no room for a KV cache in {cache.kv_cache_memory_gib} GiB")
            return num_pages, {}

        if loading_weights_bytes is not None:
            stats = {**stats, "bytes_in_use": loading_weights_bytes}

        def budget_for(temp_bytes: int) -> KVBudget:
            return budget_from_memory_stats(
                stats,
                pool_fraction=allocator_pool_fraction(),
                utilization=cache.gpu_memory_utilization,
                state_bytes=PenaltyTables.num_bytes(self.max_num_seqs, self.model.cfg.vocab_size)
                + self._draft_state_bytes,
                peak_temp_bytes=temp_bytes,
                bytes_per_page=page_bytes,
            )

        provisional_pages = self.max_pages_per_req + 1
        key = self._sizing_key(device, provisional_pages)
        record = self._temp_records.read(key) if self._temp_records and key else None
        shapes_temp = temp_estimate(self.model.cfg, self._abstract_weights, largest_buckets(self.ladder.all_buckets()))
        sized = size_kv_cache(functools.partial(self._compile_largest, device), budget_for, provisional_pages,
                              platform=device.platform,
                              known_temp_bytes=record.sized_for_bytes if record is not None else None,
                              shapes_temp_bytes=shapes_temp, any_size=self._fit_to_cache)
        if self._temp_records and key:
            self._keep_record(self._temp_records, key, record, sized)
        budget = sized.budget
        logger.info(
            "memory: %.2f GiB x %.2f = %.2f GiB; weights %.2f GiB, step temp %.2f GiB (%s %.2f GiB), "
            "KV cache %.2f GiB; temp memory from %s in %.1fs, then the largest buckets' real compiles in %.1fs",
            budget.device_memory_bytes / 2**30, budget.utilization, budget.pool_bytes / 2**30,
            budget.weights_bytes / 2**30, budget.peak_temp_bytes / 2**30,
            "recorded" if sized.from_record else "estimated", sized.estimated_temp_bytes / 2**30,
            budget.kv_bytes / 2**30, _SIZING_SOURCES[sized.source], sized.quick_seconds, sized.real_seconds,
        )
        return budget.num_pages, sized.compiled

    @staticmethod
    def _keep_record(records: TempRecords, key: str, record: StepTempRecord | None, sized: SizedKVCache) -> None:
        """Records what this start sized for, unless the record it sized from held; drops a record whose
        executables turned out other than it says (the step changed in a way the key missed)."""
        if sized.from_record and not sized.resized:
            if record is not None and sized.real_temp_bytes != record.compiled_bytes:
                logger.info("the step's temp memory is %.0f MiB compiled, where the earlier start's was %.0f MiB: "
                            "its record is dropped, and the next start estimates again",
                            sized.real_temp_bytes / 2**20, record.compiled_bytes / 2**20)
                records.forget(key)
            return
        records.write(key, StepTempRecord(sized.sized_for_bytes, sized.real_temp_bytes))

    def _sizing_key(self, device: jax.Device, provisional_pages: int) -> str | None:
        """The sizing's record key (`temp_records.py`): what fixes the step's temp memory, so the record's
        figures: the code and the versions that compile the step, the device and its runtime, the model as
        loaded, the step's shapes, kernels and options. None without records, or where it cannot be computed
        (the sizing then compiles, as without records)."""
        if self._temp_records is None:
            return None
        model = self.model
        try:
            return fingerprint(
                __version__, source_digest(), jax.__version__, jaxlib.__version__, device.platform,
                device.device_kind, device.client.platform_version,
                None if self.mesh is None else dict(self.mesh.shape),
                model.cfg, model.dtype, model.weight_dtype, model.quantization, jax.tree.structure(model.state),
                [(x.shape, x.dtype, x.sharding) for x in self._abstract_weights], self.kv_dtype,
                trace_environment(), self.page_size, self.max_pages_per_req,
                self.max_num_seqs, self.max_logprobs, self.pooling, largest_buckets(self.ladder.all_buckets()),
                provisional_pages, QUICK_ESTIMATE_OPTIONS.get(device.platform), self._compiler_options,
                jax.config.jax_default_matmul_precision, jax.config.jax_enable_x64,
                [(name, os.environ.get(name)) for name in _STEP_ENVIRONMENT],
            )
        except Exception as error:  # a record saves a round of compiles; never a reason not to start
            logger.warning("no step temp record this start: its key could not be computed (%s)", error)
            return None

    def _compile_largest(self, device: jax.Device, num_pages: int,
                         options: dict[str, Any] | None) -> dict[Bucket, CompiledBucket]:
        """The plain step of the largest mixed and decode buckets at `num_pages`, compiled at once on
        threads (they stand between the weights and the KV cache), with XLA's `options`."""
        shapes = self._shapes(num_pages)
        largest = largest_buckets(self.ladder.all_buckets())

        def compile_one(bucket: Bucket) -> CompiledBucket:
            with compile_origin.counting() as origin, trace_time.measuring() as python:
                compiled = compile_bucket(self._step, self.model.state, shapes, bucket, device, self.mesh,
                                          compiler_options=options)
            with self._compiled_lock:
                self._warmup_python += python
            return dataclasses.replace(compiled, origin=origin())

        with ThreadPoolExecutor(max_workers=min(len(largest), _COMPILE_THREADS),
                                thread_name_prefix="jaxserve-budget") as pool:
            return dict(zip(largest, pool.map(compile_one, largest), strict=True))

    def launch(self, plan: SchedulerOutput) -> LaunchedStep | None:
        """Builds the step's batch and dispatches it; None when nothing is scheduled. Raises RequestFault
        (nothing dispatched) when one request's values cannot be put in the batch."""
        self.rows.release(plan.finished_ids + plan.preempted_ids)
        self.last_step = None
        if plan.is_empty:
            return None
        num_reqs = plan.num_reqs
        bucket = self._runnable_bucket(self.ladder.pick(plan.num_tokens, num_reqs))
        self.last_step = ExecutedStep(bucket, plan.num_tokens, num_reqs)
        lora_fault = None
        if self.lora is not None and plan.new_requests:
            self._weights, lora_fault = self.lora.write(plan.new_requests, self.wait_for_weights())
        try:
            row_ids = self.rows.update(plan.new_requests, plan.request_ids, plan.new_pages)
        finally:  # after a RequestFault too: the rows written stay, and so must what they have seen
            for row, token_ids, num_prompt_tokens in self.rows.take_seen_tokens():
                self.load_seen_tokens(row, list(token_ids), num_prompt_tokens)
        if lora_fault is not None:  # once the other requests' rows are written, as `RequestRows.update` does
            raise lora_fault
        batch = build_step_batch(plan, bucket, self.layout, self.rows, row_ids)
        greedy = self.greedy_decodes and bucket.decode_only and self._all_plain_greedy(plan, batch, row_ids)
        decode_steps = None
        if plan.is_multi_step:
            if not bucket.decode_only or plan.num_steps > self.num_decode_steps:
                raise ValueError(f"a {plan.num_steps}-step plan in {bucket}: the runner runs decodes of at most "
                                 f"{self.num_decode_steps} steps")
            decode_steps = np.zeros(bucket.num_reqs, np.int32)
            decode_steps[:num_reqs] = plan.decode_steps
        if self._broadcast is not None:  # multi-host: the followers run the same step
            self._broadcast(Step(bucket, batch, greedy, decode_steps))
        sampled, prompt, pooled = self.run_step(batch, bucket, greedy, decode_steps)
        self.rows.launched(row_ids, np.array(plan.keeps_sample, np.bool_))
        return LaunchedStep(plan, batch, row_ids, self.rows.num_top_logprobs[row_ids],
                            self.rows.num_prompt_logprobs[row_ids], sampled, prompt, pooled)

    def _all_plain_greedy(self, plan: SchedulerOutput, batch: StepBatch, row_ids: np.ndarray) -> bool:
        """Whether every row of the step is greedy and asks for nothing the greedy variant leaves out:
        logprobs, a grammar, or what the runner fills row by row (penalties, bias, bans, prompt logprobs)."""
        num_rows, sampling = plan.num_reqs, batch.sampling
        return not (plan.grammar_rows or sampling.wants_logprobs[:num_rows].any()
                    or sampling.temperature[:num_rows].any() or self.rows.row_features[row_ids].any())

    def collect_steps(self, launched: LaunchedStep) -> list[StepOutput]:
        """Waits for a launched multi-step decode's samples: one `StepOutput` per step of its plan."""
        plan, sampled = launched.scheduler_output, launched.sampled
        num_reqs = plan.num_reqs
        rank_rows = np.flatnonzero(launched.batch.sampling.wants_logprobs[:num_reqs]).tolist()
        if rank_rows:
            tokens, logprobs, ranks = to_host((sampled.tokens, sampled.logprobs, sampled.ranks))  # [k, R]
        else:
            tokens, logprobs = to_host((sampled.tokens, sampled.logprobs))  # [k, R]
        return [StepOutput(plan.request_ids, tokens[step, :num_reqs].tolist(), logprobs[step, :num_reqs].tolist(),
                           ranks={row: int(ranks[step, row]) for row in rank_rows})
                for step in range(plan.num_steps)]

    def collect(self, launched: LaunchedStep) -> StepOutput:
        """Waits for a launched step's samples and turns them into per-request results."""
        plan, batch = launched.scheduler_output, launched.batch
        num_reqs = plan.num_reqs
        top_rows = np.flatnonzero(batch.sampling.wants_top_logprobs[:num_reqs]).tolist()
        rank_rows = np.flatnonzero(batch.sampling.wants_logprobs[:num_reqs]).tolist()
        sampled = launched.sampled
        top_logprobs: dict[int, dict[int, float]] = {}
        if top_rows:
            out = to_host(sampled)
            tokens, logprobs, ranks = out.tokens, out.logprobs, out.ranks
            for row in top_rows:
                k = launched.num_top_logprobs[row]
                ids, lps = out.top_token_ids[row, :k].tolist(), out.top_logprobs[row, :k].tolist()
                top_logprobs[row] = dict(zip(ids, lps, strict=True))
        elif rank_rows:  # no row asked for alternatives: their arrays stay on the device
            tokens, logprobs, ranks = to_host((sampled.tokens, sampled.logprobs, sampled.ranks))
        else:
            tokens, logprobs = to_host((sampled.tokens, sampled.logprobs))
        return StepOutput(
            request_ids=plan.request_ids,
            sampled_token_ids=tokens[:num_reqs].tolist(),
            logprobs=logprobs[:num_reqs].tolist(),
            top_logprobs=top_logprobs,
            ranks={row: int(ranks[row]) for row in rank_rows},
            prompt_logprobs=self._prompt_logprobs(launched) if plan.prompt_logprob_targets else {},
            pooled=self._pooled(launched) if launched.pooled is not None else {},
        )

    @staticmethod
    def _pooled(launched: LaunchedStep) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Per row: its hidden state at its first and its last token this step and the sum over its tokens,
        f32[D] each."""
        first, last, sums = to_host(launched.pooled)
        return {row: (first[row], last[row], sums[row]) for row in range(launched.scheduler_output.num_reqs)}

    def _prompt_logprobs(self, launched: LaunchedStep) -> dict[int, tuple[int, list[dict[int, Logprob]]]]:
        """Per row scoring prompt tokens this step: (its first scored token, {token: Logprob} per token with
        the prompt's token first, then the top alternatives it asked for)."""
        plan, batch = launched.scheduler_output, launched.batch
        prompt = to_host(launched.prompt)
        cu_q_lens = batch.attention.cu_q_lens
        result = {}
        for row, targets in plan.prompt_logprob_targets.items():
            first = cu_q_lens[row]
            k = launched.num_prompt_logprobs[row]
            entries = []
            for i, target in zip(range(first, first + len(targets)), targets, strict=True):
                entry = {target: Logprob(float(prompt.token_logprobs[i]), int(prompt.ranks[i]))}
                for rank, (token, logprob) in enumerate(zip(prompt.top_token_ids[i, :k].tolist(),
                                                            prompt.top_logprobs[i, :k].tolist(), strict=True)):
                    entry.setdefault(token, Logprob(logprob, rank + 1))
                entries.append(entry)
            result[row] = (plan.start_positions[row] + 1, entries)
        return result

    def load_seen_tokens(self, slot: int, token_ids: list[int], num_prompt_tokens: int) -> None:
        """Counts tokens a request's row has seen (a prefix-cache hit with penalties) into its penalty row."""
        if self._broadcast is not None:
            self._broadcast(LoadSeenTokens(slot, token_ids, num_prompt_tokens))
        self.replay_seen_tokens(slot, token_ids, num_prompt_tokens)

    def replay_seen_tokens(self, slot: int, token_ids: list[int], num_prompt_tokens: int) -> None:
        """`load_seen_tokens` on this process alone (warm-up; a multi-host follower replaying the leader)."""
        prompt_mask, output_counts = seen_tokens(token_ids, num_prompt_tokens, self.model.cfg.vocab_size)
        self.penalty_tables = self._load_penalty_row(self.penalty_tables, jnp.int32(slot), prompt_mask, output_counts)

    def run_step(self, batch: StepBatch, bucket: Bucket, greedy: bool = False, decode_steps: np.ndarray | None = None,
                 ) -> tuple[SamplerOutput, PromptLogprobs | None, tuple[jax.Array, jax.Array] | None]:
        """Dispatches the step (its greedy variant if `greedy` and compiled; a multi-step decode if
        `decode_steps`, i32[R], the steps per row); its outputs stay on the device. (A multi-host follower
        runs the leader's steps here, each process feeding its own previous samples.)"""
        multi_step = decode_steps is not None
        with self._compiled_lock:
            variant = StepVariant(greedy, multi_step)
            step = self._compiled_step(bucket, variant)
            if step is None and greedy:  # not compiled (yet): the full sampler gives the same tokens
                variant = StepVariant(multi_step=multi_step)
                step = self._compiled_step(bucket, variant)
            if step is None:  # the jitted function compiles what warm-up did not
                step = self._step_fns[variant]
            self.num_greedy_steps += variant.greedy
            self.num_multi_steps += multi_step
        batch = dataclasses.replace(batch, previous_tokens=self._previous_tokens)
        packed = pack(batch, bucket, self.layout)  # a numpy buffer of words, one of flags
        packed = dataclasses.replace(packed, held=tuple(self._on_device(x) for x in packed.held))
        weights = self.wait_for_weights()
        if multi_step:
            self.kv_caches, self.penalty_tables, sampled, self._previous_tokens = step(
                weights, self.kv_caches, self.penalty_tables, packed, decode_steps)
            return sampled, None, None
        if variant == PLAIN and self.sample_apart:
            self.kv_caches, self.penalty_tables, logits, sampling, prompt, *pooled = step(
                weights, self.kv_caches, self.penalty_tables, packed)
            sampler = self._compiled_samplers.get(bucket.num_reqs, self._sample_fn)
            sampled, self._previous_tokens, self.penalty_tables = sampler(logits, sampling, self.penalty_tables)
        else:
            self.kv_caches, self.penalty_tables, sampled, prompt, self._previous_tokens, *pooled = step(
                weights, self.kv_caches, self.penalty_tables, packed)
        return sampled, prompt, pooled[0] if pooled else None

    def _compiled_step(self, bucket: Bucket, variant: StepVariant) -> Any | None:
        return self._compiled.get(bucket) if variant == PLAIN else self._compiled_variants.get((bucket, variant))

    def _on_device(self, array: np.ndarray) -> np.ndarray | jax.Array:
        """A shared read-only input (a wide one no row of the step uses, `batch.neutral_batch`) as its device
        copy, made once; any other array as it is. Saves copying 1.8 MB per step at 256 rows. Not in a
        multi-process job, where a device array would span the other processes."""
        if not isinstance(array, np.ndarray) or array.flags.writeable or not self._single_process:
            return array
        held = self._device_copies.get(id(array))
        if held is None:  # keyed by id: the host array is held with its copy, so the id stays its own
            placement = None if self.mesh is None else replicated(self.mesh)
            held = self._device_copies[id(array)] = (array, jax.device_put(array, placement))
        return held[1]

    def _runnable_bucket(self, wanted: Bucket) -> Bucket:
        """`wanted` once it is compiled; until then (a background warm-up) the smallest compiled bucket
        that holds the step, so no step waits for a compile."""
        with self._compiled_lock:
            if not self._compiled or wanted in self._compiled:
                return wanted
            fits = [b for b in self._compiled if b.num_tokens >= wanted.num_tokens and b.num_reqs >= wanted.num_reqs
                    and (wanted.decode_only or not b.decode_only)]
        return min(fits) if fits else wanted

    def warmup(self, show_progress: bool = True, mode: str = "full", meanwhile: Callable[[], None] | None = None,
               ) -> float:
        """Compiles the step for every bucket ahead of time; returns the seconds until steps can run.

        Buckets compile a few at once on threads (XLA releases the GIL while it compiles; tracing does
        not), the largest mixed bucket first, and JAX's persistent cache serves repeated starts. `mode`
        (config.WARMUP_MODES): full returns once every bucket is compiled. background (and auto, which the
        engine core turns into full across hosts) returns once the largest mixed bucket, which holds any
        step, is compiled; the others compile on one thread fewer while steps run (smallest decode buckets
        first), each step in the smallest compiled bucket that holds it. On a cold cache too: a server
        ready early answers its first clients sooner than one that compiled every bucket first, though its
        first steps share the cores with compiles (docs/benchmarks.md). Buckets compiled before ready are
        also run once (on the empty batch); the others pay their first run's extra cost on first use.
        `meanwhile` runs on this thread while the first of those runs is on the device (host work of the
        start's that would otherwise wait for it).
        """
        start = time.perf_counter()
        self.replay_seen_tokens(0, [], 0)  # compiles the penalty-row load (a zero row: no slot is in use yet)
        buckets: list[Bucket] = self.ladder.all_buckets()
        largest = max(b for b in buckets if not b.decode_only)
        jobs = self._jobs([largest, *sorted(set(buckets) - {largest}, key=lambda b: (not b.decode_only, b))])
        slots = threading.Semaphore(_COMPILE_THREADS)
        pool = ThreadPoolExecutor(max_workers=_COMPILE_THREADS, thread_name_prefix="jaxserve-compile")
        # All at once, but with `background` the others only once the engine is ready (on the first's heels):
        # started beside it, their tracing holds the GIL the first needs (a later ready; docs/benchmarks.md).
        background = mode != "full"
        futures = [pool.submit(self._compile_one, job, slots) for job in jobs[:1 if background else None]]
        try:
            first_origin = futures[0].result()
            ready_jobs = 1 if background else len(jobs)
            waited = futures[:ready_jobs]
            for future in progress(waited, "Compiling buckets", logger, unit="buckets") if show_progress else waited:
                future.result()
        except BaseException:  # a bucket that fails to compile fails the start: the queued ones are dropped
            self._stop_compiling.set()
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        for bucket, variant in jobs[:ready_jobs]:  # an executable's first run costs extra once (0.6 s for
            # 128 x 16 on CPU): pay it here and wait for it: dispatch is asynchronous, and an unawaited run is
            # paid by the first request (its step waited ~4 s behind them on CPU)
            outputs = self.run_step(neutral_batch(bucket, self.layout), bucket, variant.greedy,
                                    self._no_decode_steps(bucket) if variant.multi_step else None)
            try:
                if meanwhile is not None:
                    meanwhile, run_now = None, meanwhile
                    run_now()
            finally:
                jax.block_until_ready(outputs)
        self.num_greedy_steps = self.num_multi_steps = 0
        futures += [pool.submit(self._compile_one, job, slots) for job in jobs[len(futures):]]
        pool.shutdown(wait=False)  # its threads work through the queue; nothing more is submitted
        ready = time.perf_counter() - start
        if not background:
            self._log_compiled(futures)
            logger.info("warm-up: %d buckets compiled in %.1fs", len(buckets), ready)
            return ready
        logger.info("warm-up: 1 of %d buckets compiled in %.1fs (%s); compiling the rest in the background",
                    len(buckets), ready, first_origin)

        @fewer_collections()  # the rest of the tracing (collector.py)
        def finish() -> None:
            keep_a_core = _COMPILE_THREADS > 1
            if keep_a_core:  # one compile fewer at a time from here: a core stays with the steps being served
                slots.acquire()
            try:
                for future in futures:
                    future.result()
            finally:
                if keep_a_core:
                    slots.release()
            self._log_compiled(futures)
            if not self._stop_compiling.is_set():
                logger.info("warm-up: all %d buckets compiled in %.1fs", len(buckets), time.perf_counter() - start)

        self._background = threading.Thread(target=finish, name="jaxserve-warmup", daemon=True)
        self._background.start()
        return ready

    def decode_steps_ready(self) -> int:
        """The most decode steps one dispatch runs without compiling on the caller's thread: 1 while a
        background warm-up is still compiling (it compiles the multi-step variants last), else
        `num_decode_steps`. A multi-step plan in a bucket whose variant is missing would otherwise compile it
        in the step, through the jitted function: a stall of the engine's loop, and a second compile of what
        the warm-up compiles, under another persistent-cache key (lowered from the runner's own arrays)."""
        if self._background is not None and self._background.is_alive():
            return 1
        return self.num_decode_steps

    def wait_for_warmup(self, timeout: float | None = None) -> None:
        """Blocks until a background warm-up has compiled every bucket."""
        if self._background is not None:
            self._background.join(timeout)

    def stop_warmup(self) -> None:
        """Stops a background warm-up: the queued compiles are dropped. Those under way go on in their
        threads (XLA cannot interrupt a compile); a shutdown does not wait for them (process_exit.py)."""
        self._stop_compiling.set()

    def _jobs(self, buckets: list[Bucket]) -> list[tuple[Bucket, StepVariant]]:
        """What warm-up compiles for `buckets`: each plain, and the decode buckets' variants turned on."""
        variants = [StepVariant(greedy, multi_step) for multi_step in (False, True) for greedy in (False, True)
                    if (greedy or multi_step) and (self.greedy_decodes or not greedy)
                    and (self.num_decode_steps > 1 or not multi_step)]
        return ([(bucket, PLAIN) for bucket in buckets]
                + [(bucket, variant) for variant in variants for bucket in buckets if bucket.decode_only])

    @staticmethod
    def _no_decode_steps(bucket: Bucket) -> np.ndarray:
        return np.zeros(bucket.num_reqs, np.int32)  # i32[R]: a multi-step decode's rows, all padding

    def _compile_one(self, job: tuple[Bucket, StepVariant], slots: threading.Semaphore) -> str | None:
        """Compiles one (bucket, variant) into the table, holding one of `slots`; returns where its
        executables came from (`compile_origin`), or None where it was skipped (the warm-up was stopped)."""
        if self._stop_compiling.is_set():
            return None
        bucket, variant = job
        sized = self._sized_executables.get(bucket) if variant == PLAIN else None
        with slots:
            # The bucket runs once its sampler is compiled too (`sample_apart`): compiled first, by one bucket
            # per request bucket while the others wait for it here.
            sampler_origin = self._compile_sampler(bucket.num_reqs) if variant == PLAIN else compile_origin.KEPT
            if sampler_origin is None:
                return None
            if sized is not None:
                with self._compiled_lock:
                    self._compiled[bucket] = sized.compiled
                return compile_origin.worst(sized.origin, sampler_origin)
            args = abstract_step_args(self.model.state, self._step_shapes, bucket, jax.devices()[0], self.mesh,
                                      variant.multi_step)
            with compile_origin.counting() as origin, trace_time.measuring() as python:
                with TRACING:
                    if self._stop_compiling.is_set():  # stopped while this job waited for its turn
                        return None
                    lowered = self._step_fns[variant].trace(*args).lower()
                compiled = lowered.compile()
        with self._compiled_lock:
            if variant == PLAIN:
                self._compiled[bucket] = compiled
            else:
                self._compiled_variants[bucket, variant] = compiled
            self._warmup_python += python
        return compile_origin.worst(origin(), sampler_origin)

    def _compile_sampler(self, num_reqs: int) -> str | None:
        """Compiles the sampler's program for `num_reqs` rows unless it is (`sample_apart` only); returns
        where its executable came from (KEPT where this runner has it), or None where the warm-up was stopped."""
        if not self.sample_apart:
            return compile_origin.KEPT
        with self._sampler_locks[num_reqs]:
            if num_reqs in self._compiled_samplers:
                return compile_origin.KEPT
            if self._stop_compiling.is_set():
                return None
            args = abstract_sample_args(self._step_shapes, num_reqs, jax.devices()[0], self.mesh)
            with compile_origin.counting() as origin:
                with TRACING:
                    lowered = self._sample_fn.trace(*args).lower()
                self._compiled_samplers[num_reqs] = lowered.compile()
            return origin()

    def _log_compiled(self, futures: list[Future[str | None]]) -> None:
        origins = [origin for origin in (f.result() for f in futures) if origin is not None]
        kept = origins.count(compile_origin.KEPT)
        python = self._warmup_python
        logger.info("compiled %d buckets on %d threads, %d from the persistent cache%s; jax traced their steps for "
                    "%.1fs and lowered them for %.1fs (Python: one compile at a time)", len(origins), _COMPILE_THREADS,
                    origins.count(compile_origin.LOADED), f", {kept} {compile_origin.KEPT}" if kept else "",
                    python.trace_seconds, python.lower_seconds)


class LoraWriter:
    """--enable-lora: the adapters the engine serves, by id, and their writes into the device slot the
    scheduler gave each, when a request of it starts and the slot holds another (a new array per stack: a
    step in flight keeps reading the old ones). The weights list is the step's first argument; the stacks
    are its leaves at `leaves`."""

    def __init__(self, model: LoadedModel) -> None:
        self.adapters: dict[int, LoraAdapter] = {}
        self.shapes = stack_shapes(model.state)
        self.rank, self.max_loras = model.cfg.lora.max_rank, model.cfg.lora.max_loras
        index = {tuple(key.key for key in path if isinstance(key, jax.tree_util.DictKey)): i
                 for i, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(model.state)[0])}
        self.leaves = [(index[(*stack, "lora_a")], index[(*stack, "lora_b")]) for stack in self.shapes]
        self.dtype = jax.tree.leaves(model.state)[self.leaves[0][0]].dtype
        self.in_slot: list[int | None] = [None] * self.max_loras  # the adapter each slot holds
        self.num_writes = 0  # slots written, for tests and logs

        def write_slot(stacks: list[tuple[jax.Array, jax.Array]], values: list[tuple[jax.Array, jax.Array]],
                       slot: jax.Array) -> list[tuple[jax.Array, jax.Array]]:
            return [(a.at[:, slot].set(new_a), b.at[slot].set(new_b))
                    for (a, b), (new_a, new_b) in zip(stacks, values, strict=True)]

        self._write_slot = jax.jit(write_slot)
        # Compiled now rather than on the engine thread when the first adapter starts: slot 0 written with
        # its zeros, the result dropped.
        leaves = jax.tree.leaves(model.state)
        zeros = slot_values(None, self.shapes, self.rank, self.dtype)
        jax.block_until_ready(self._write_slot([(leaves[a], leaves[b]) for a, b in self.leaves],
                                               list(zeros.values()), np.int32(0)))

    def write(self, new_requests: tuple[NewRequest, ...], weights: list[jax.Array]
              ) -> tuple[list[jax.Array], RequestFault | None]:
        """The weights with the starting requests' adapters in their slots (the same list where nothing
        moves), and the fault of a request whose adapter is gone (the core refuses those before they queue:
        a bug), for the runner to raise once the other rows are written."""
        fault = None
        for new in new_requests:
            if new.lora_id is None or self.in_slot[new.lora_slot] == new.lora_id:
                continue
            adapter = self.adapters.get(new.lora_id)
            if adapter is None:
                fault = fault or RequestFault(new.request_id)
                continue
            values = slot_values(adapter, self.shapes, self.rank, self.dtype)
            stacks = [(weights[a], weights[b]) for a, b in self.leaves]
            written = self._write_slot(stacks, list(values.values()), np.int32(new.lora_slot))
            weights = list(weights)
            for (a, b), (new_a, new_b) in zip(self.leaves, written, strict=True):
                weights[a], weights[b] = new_a, new_b
            self.in_slot[new.lora_slot] = new.lora_id
            self.num_writes += 1
            logger.debug("LoRA adapter %d written to slot %d", new.lora_id, new.lora_slot)
        return weights, fault
