"""`jaxserve compile`: the whole step (model, attention kernels, sampler) compiled for every bucket of a
ladder, for a GPU this machine does not have (or for the local device), with a roofline per bucket. On a
CPU, as `serve` runs it there, the plain step stops at the logits and a row per request bucket holds its
sampler's program (`step_fn.samples_apart`).

Nothing runs: the model is built from its config alone (shapes, no weights), the step's arguments are
`ShapeDtypeStruct`s on the target device, and XLA compiles them as it would on that GPU (Triton and ptxas
included), so a kernel that asks for too much shared memory, or an op XLA:GPU cannot compile, fails here.
Buckets compile on `jobs` threads (XLA releases the GIL while it compiles). With `variants`, each decode
bucket is also compiled as the variants the preset turns on, as `serve` would: the greedy decode step
(`greedy_decodes`) and the multi-step decodes (`num_scheduler_steps` > 1), so the report holds exactly
what a device of the target's kind would compile. A pooling engine's (`--runner pooling`, which a classifier
chooses) is its plain step returning the pooled hidden states, or a classifier's class logits, with no variants.

Per bucket the report has XLA's memory analysis, XLA's cost analysis of the same step lowered for the CPU
with the reference attention (deviceless GPU compiles return no cost analysis; see the caveat in
docs/benchmarks.md), and the analytic roofline of `jaxserve.roofline`, which the predicted times use.
"""

import dataclasses
import functools
import json
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util
from jax.sharding import Mesh

from jaxserve.collector import fewer_collections
from jaxserve.config import AUTO_MAX_MODEL_LEN, FEATURE_METHODS, EngineConfig, SpeculativeConfig, context_served
from jaxserve.device import DeviceFacts, deviceless_devices, local_facts, target_facts
from jaxserve.engine.eagle_proposer import check_target_windows
from jaxserve.engine.pooling_mode import encoder_config, encoder_context
from jaxserve.models import is_encoder
from jaxserve.models.classifier import num_classes
from jaxserve.models.eagle import DrafterLayout, EagleConfig, EagleLlama
from jaxserve.models.eagle import split_rule as eagle_split_rule
from jaxserve.models.eagle3 import Eagle3Config, Eagle3Llama
from jaxserve.models.features import FeaturePages, feature_pages
from jaxserve.models.fp8_layout import kernel_layout
from jaxserve.models.layers import LoraShape, context_length
from jaxserve.models.loader import AbstractModel, build_abstract_model, resolve_dtype, resolve_model_config
from jaxserve.models.lora import abstract_with_lora
from jaxserve.models.mtp import MtpDrafter, checkpoint_heads, mtp_config
from jaxserve.models.mtp import split_rule as mtp_split_rule
from jaxserve.models.quantization import (
    checkpoint_contracted_block,
    checkpoint_quantization,
    layer_matmul_dtype,
    layer_weight_itemsize,
    quantize_state,
)
from jaxserve.ops.attention import AttentionConfig, resolve_attention
from jaxserve.ops.attention import kv_cache_dtype as resolve_kv_cache_dtype  # the parameter takes the name
from jaxserve.ops.kv_write import padding_slot
from jaxserve.parallel import TP_AXIS, bytes_per_device
from jaxserve.roofline import model_shape, step_cost
from jaxserve.runner import trace_time
from jaxserve.runner.aot import (
    CompiledBucket,
    StepShapes,
    abstract_step_args,
    compile_bucket,
    compile_sampler,
    page_bytes_on_device,
    step_compiler_options,
    step_shapes,
    temp_estimate,
)
from jaxserve.runner.buckets import Bucket, BucketLadder, largest_buckets
from jaxserve.runner.kv_budget import KVBudget, fit_to_kv_cache, pages_in_host_memory
from jaxserve.runner.kv_sizing import with_margin
from jaxserve.runner.launches import StepLaunches
from jaxserve.runner.penalties import PenaltyTables
from jaxserve.runner.step_fn import make_decode_steps_fn, make_sample_fn, make_step_fn, samples_apart

logger = logging.getLogger(__name__)


def load_model_config(model: str | None, revision: str | None = None, download_dir: str | None = None,
                      hf_overrides: dict[str, Any] | None = None) -> tuple[str, Any]:
    """(name, transformers config) for a bundled shape name, a config.json file, or anything --model takes
    (serve's --revision, --download-dir and --hf-overrides applied as serve applies them)."""
    source, hf_config = resolve_model_config(model, revision, download_dir, hf_overrides)
    return source.name, hf_config


@dataclass(frozen=True)
class BucketResult:
    num_tokens: int
    num_reqs: int
    decode_only: bool
    compile_seconds: float
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    xla_flops: float | None  # XLA's cost analysis of the CPU lowering (reference attention, full page table)
    xla_bytes: float | None
    flops: float  # the analytic roofline's counts, at context_len keys per request
    bytes: float
    predicted_seconds: float | None
    bound: str | None  # "compute" or "memory"
    collectives: dict[str, int]  # cross-device ops in the compiled step (tensor parallelism), by kind
    launches: StepLaunches | None  # what the step launches and which command buffers hold it (GPU targets)
    # Which step function: "plain", or a decode bucket's "greedy", "multi-step" or "multi-step greedy"
    # (the roofline figures stay one decode step's), or on CPU targets a request bucket's "sampler"
    # (`step_fn.make_sample_fn`; no roofline).
    variant: str = "plain"
    # Of compile_seconds, jax's tracing and lowering (Python: one compile at a time under the GIL;
    # runner/trace_time.py)
    trace_seconds: float = 0.0
    lower_seconds: float = 0.0


@dataclass(frozen=True)
class CompileReport:
    model: str
    device: str
    target: str | None
    dtype: str
    attention: str
    page_size: int
    kv_cache_dtype: str
    bytes_per_page: int  # one device's share of a page: K and V of every layer, hidden states kept, a drafter's
    max_model_len: int
    max_num_seqs: int
    context_len: int  # the keys each request attends in the predictions
    jobs: int
    tensor_parallel_size: int  # devices the step is split over; memory figures are one device's
    weights_bytes: int  # one device's share
    state_bytes: int
    max_temp_bytes: int
    estimated_temp_bytes: int  # the KV sizing's estimate from the step's shapes (runner/kv_sizing.py)
    gpu_memory_utilization: float
    device_memory_bytes: int | None
    kv_budget: KVBudget | None  # how the KV budget was reached (None off GPUs)
    kv_budget_bytes: int | None
    num_kv_pages: int
    num_kv_pages_given: bool  # --num-kv-pages (the preset's or the flag's), not a budget
    compile_seconds: float  # the ladder's, summed over buckets
    trace_seconds: float  # of it, jax's tracing and lowering, summed over buckets (BucketResult)
    lower_seconds: float
    wall_seconds: float
    buckets: list[BucketResult]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


@dataclass(frozen=True)
class _Drafter:
    """An EAGLE, EAGLE-3 or MTP drafter built from configs alone: its model (ShapeDtypeStruct weights, placed over
    the target's mesh as serve places them), and what the target keeps for it (`feature_layers`, as
    `make_step_fn` takes them)."""

    cfg: Any  # heads laid out for the mesh
    graphdef: Any
    state: Any
    feature_layers: tuple[int, ...]
    shared: tuple[str, ...]  # its parameters that are the target's tables (not counted again)

    @classmethod
    def of(cls, speculative: SpeculativeConfig, target: AbstractModel, dtype: Any, download_dir: str | None
           ) -> "_Drafter":
        """The drafter `speculative` names beside `target`: a model's MTP layer from the target's config; an
        EAGLE drafter from its own config.json (a hub id's alone is fetched), its checkpoint's choices as the
        EAGLE authors' checkpoints make them (`fc` with a bias; EAGLE-3's own LM head over its draft vocabulary,
        the target's embeddings). Over the target's mesh, its heads laid out and its weights split as
        `models/mtp.py` and `models/eagle.py` lay them out."""
        target_cfg = target.cfg
        if speculative.method == "mtp":
            laid_out = mtp_config(target_cfg)
            cfg = checkpoint_heads(laid_out, target.checkpoint_cfg)
            module, shared = MtpDrafter, ("embed_tokens", "lm_head")
            rule = functools.partial(mtp_split_rule, cfg=laid_out)
        else:
            check_target_windows(target_cfg)  # as serve refuses it
            _, hf = resolve_model_config(speculative.model, speculative.revision, download_dir)
            if speculative.method == "eagle3":
                cfg = Eagle3Config.for_target(hf, target_cfg, ["lm_head.weight", "d2t"], target_cfg.attention)
                module, shared = Eagle3Llama, ("embed_tokens",)
            else:
                cfg = EagleConfig.for_target(hf, target_cfg, True, target_cfg.attention)
                module, shared = EagleLlama, ("embed_tokens", "lm_head")
            rule = functools.partial(eagle_split_rule, cfg=cfg)
        layout = DrafterLayout.over(target.mesh, cfg.num_heads, cfg.num_kv_heads, rule)
        cfg = cfg if layout is None else layout.config(cfg)
        graphdef, state = nnx.split(nnx.eval_shape(lambda: module(cfg, dtype, None)))
        if layout is not None:  # each weight placed as serve places it (`DrafterLayout.place`)
            flat = traverse_util.flatten_dict(nnx.to_pure_dict(state))
            nnx.replace_by_pure_dict(state, traverse_util.unflatten_dict({
                path: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=layout.sharding(path, leaf.shape))
                for path, leaf in flat.items()}))
        return cls(cfg, graphdef, state, getattr(cfg, "target_layers", ()), shared)

    def _own_leaves(self) -> list[Any]:
        pure = nnx.to_pure_dict(self.state)
        return jax.tree.leaves({key: value for key, value in pure.items() if key not in self.shared})

    @property
    def own_weights_bytes(self) -> int:
        """One device's share of its weights, the target's tables it shares left out."""
        return bytes_per_device(self._own_leaves())

    @property
    def num_params(self) -> int:  # the roofline's: every weight a step reads, the shared tables too
        return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.state))

    def target_features(self, target_cfg: Any, dtype: Any) -> FeaturePages:
        """The pages of hidden states the target keeps for it."""
        return feature_pages(target_cfg, dtype, self.feature_layers)

    def features(self, dtype: Any) -> FeaturePages:
        """The pages of its own features."""
        return feature_pages(self.cfg, dtype)

    def shapes(self, page_size: int, num_pages: int, max_pages_per_req: int, max_num_seqs: int,
               dtype: Any) -> StepShapes:
        return step_shapes(self.cfg, dtype, page_size, num_pages, max_pages_per_req, max_num_seqs, 0,
                           self.features(dtype))


@fewer_collections()  # the ladder's tracing (collector.py)
def compile_ladder(
    model: str | None,
    target: str | None = None,
    preset: str | Path | None = "gpu",
    dtype: str = "auto",
    attention_impl: str = "auto",
    max_model_len: int | None = None,
    context_len: int | None = None,
    gpu_memory_utilization: float | None = None,
    kv_cache_dtype: str | None = None,
    num_kv_pages: int | None = None,
    jobs: int = 1,
    xla_cost: bool = True,
    buckets: list[Bucket] | None = None,
    tensor_parallel_size: int = 1,
    enable_expert_parallel: bool = False,
    quantization: str | None = None,
    read_launches: bool = True,
    variants: bool = True,
    lora: LoraShape | None = None,
    revision: str | None = None,
    download_dir: str | None = None,
    hf_overrides: dict[str, Any] | None = None,
    enforce_eager: bool = False,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    speculative_config: SpeculativeConfig | None = None,
) -> CompileReport:
    """Compiles the step for every bucket of `preset`'s ladder (or `buckets`) for `target` (None: local).

    For a named target the process's jax platform must be the CPU (`jaxserve.device.use_cpu_platform`).
    With `tensor_parallel_size` N > 1 the step is compiled split over N devices (N GPUs of one node for a
    target, deviceless), memory figures are per device, and neither XLA's CPU cost analysis nor the
    roofline (which would ignore the collectives) is reported. `read_launches`: what each bucket's step
    launches (XLA dumps its thunks for it: ~10% more compile time). `variants`: the decode buckets' variants
    the preset turns on, each its own row (module docstring). `lora`: the step with --enable-lora's adapter
    slots, as a LoRA server compiles it. `enforce_eager`, `max_num_seqs`, `max_num_batched_tokens`,
    `speculative_config`: as serve takes them (the limits extend the preset's ladder where they pass it; the
    speculative config sizes the draft rows' penalty inputs). With an EAGLE or MTP drafter (`_Drafter`), the
    target's step keeps its hidden states in pages beside its K/V, and the drafter's steps are rows of their
    own, as its runner warms up and runs them ("draft": its plain step, the catch-ups, in every bucket; "draft
    greedy" and "draft multi-step", a round's k - 1 decode steps in one call, in the decode buckets; with
    `variants` too), their weights (not the target's tables, which it shares where its checkpoint keeps no
    copies of its own) and pages in the KV budget as serve counts them.
    """
    wall_start = time.perf_counter()
    source, hf_config = resolve_model_config(model, revision, download_dir, hf_overrides)
    name = source.name
    cache_options = {key: value for key, value in (("kv_cache_dtype", kv_cache_dtype), ("num_kv_pages", num_kv_pages))
                     if value is not None}
    config = EngineConfig.from_preset(preset, gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      speculative_config=speculative_config, **cache_options)
    tp = tensor_parallel_size
    facts: DeviceFacts = target_facts(target) if target else local_facts(jax.devices()[0])
    # XLA's memory limit as a real GPU's compile gets it: serve's allocator pool
    pool = int(facts.memory_bytes * config.cache.gpu_memory_utilization) if facts.memory_bytes else None
    devices = deviceless_devices(target, tp, allocator_pool_bytes=pool) if target else jax.devices()[:tp]
    if len(devices) < tp:
        raise ValueError(f"--tensor-parallel-size {tp} needs {tp} local devices; this process sees {len(devices)}")
    device, mesh = devices[0], Mesh(np.asarray(devices), (TP_AXIS,)) if tp > 1 else None
    jax_dtype = resolve_dtype(dtype, facts.platform)
    attention = dataclasses.replace(resolve_attention(attention_impl, facts, config.cache.kv_cache_dtype), mesh=mesh)
    abstract = build_abstract_model(hf_config, jax_dtype, attention, expert_parallel=enable_expert_parallel)
    if lora is not None:
        abstract = abstract_with_lora(abstract, lora, jax_dtype)
    if quantization == "gguf":
        raise ValueError("--quantization gguf runs on CPUs, from a GGUF file's blocks: not compiled deviceless")
    if (stored := checkpoint_quantization(hf_config)) is not None and quantization in (None, "auto"):
        quantization = stored  # as serve loads the checkpoint
    # an FP8 checkpoint's weights keep its form of scales (the layer weights and experts it leaves in 16 bits,
    # its `modules_to_not_convert`, are compiled in FP8 here)
    block = checkpoint_contracted_block(hf_config) if stored == "fp8" and quantization == "fp8" else 0
    if quantization is not None:  # as a load places them (`AbstractModel.fp8_block_of`)
        quantize_state(abstract.state, abstract.spec.module, quantization, block, abstract.fp8_block_of(block))
        kernel_layout(abstract.state, attention)  # as the runner lays them out
    drafter = None
    if speculative_config is not None and speculative_config.method in FEATURE_METHODS:
        drafter = _Drafter.of(speculative_config, abstract, jax_dtype, download_dir)
    state = abstract.placed_state() if mesh is not None else abstract.state
    xla_cost = xla_cost and mesh is None
    cfg = abstract.cfg
    context = context_length(hf_config, cfg.max_position_embeddings)  # as serve caps it (engine/core.py)
    asked = max_model_len or config.model.max_model_len
    if is_encoder(cfg):  # its prompts whole in a step, its pages those of two steps (engine/pooling_mode.py)
        config = encoder_config(dataclasses.replace(config, model=dataclasses.replace(config.model,
                                                                                      max_model_len=asked)),
                                encoder_context(context, source))
        asked = config.model.max_model_len
    max_len = context_served(asked, context)
    sched, cache = config.scheduler, config.cache
    ladder = BucketLadder(config.buckets.token_buckets, config.buckets.request_buckets,
                          sched.max_num_batched_tokens, sched.max_num_seqs)
    todo = buckets or ladder.all_buckets()
    itemsize = jnp.dtype(jax_dtype).itemsize
    cache_dtype = resolve_kv_cache_dtype(cache.kv_cache_dtype, jax_dtype, attention.impl,
                                         attention.compute_capability)
    features = None if drafter is None else drafter.target_features(cfg, jax_dtype)
    # One device's share of a page, as serve counts it (model_runner.kv_page_bytes): the target's K/V and the
    # hidden states it keeps for a drafter, and the drafter's own pages (page for page)
    page_bytes = page_bytes_on_device(step_shapes(cfg, cache_dtype, cache.page_size, 1, 1, 1, 0, features),
                                      device, mesh)
    if drafter is not None:
        page_bytes += page_bytes_on_device(drafter.shapes(cache.page_size, 1, 1, 1, jax_dtype), device, mesh)
    max_pages_per_req = -(-max_len // cache.page_size)
    options = step_compiler_options(enforce_eager, device.platform)
    # A pooling engine's step (--runner pooling, which a classifier or an encoder chooses) returns the pooled
    # hidden states, draws no sample, and has no decode variants
    pooling = config.runner == "pooling" or (config.runner == "auto" and (num_classes(cfg) > 0 or is_encoder(cfg)))
    # the plain step's sampler a program of its own, as serve runs it
    apart = samples_apart(device.platform) and not pooling
    feature_layers = None if drafter is None else drafter.feature_layers
    step = make_step_fn(abstract.graphdef, jax.tree.structure(abstract.state), config.model.max_logprobs, mesh,
                        pooling=pooling, sample_apart=apart, compiler_options=options, feature_layers=feature_layers)
    weights_bytes = abstract.weights_bytes_per_device
    state_bytes = PenaltyTables.num_bytes(sched.max_num_seqs, cfg.vocab_size)
    if drafter is not None:  # its weights but the target's tables it shares, and its runner's penalty tables
        weights_bytes += drafter.own_weights_bytes
        state_bytes += PenaltyTables.num_bytes(sched.max_num_seqs, cfg.vocab_size)

    def shapes_for(num_pages: int) -> StepShapes:
        return step_shapes(cfg, cache_dtype, cache.page_size, num_pages, max_pages_per_req, sched.max_num_seqs,
                           sched.max_drafts, features)

    # The page count is an argument shape, and the budget needs the step's temp memory: the cache is sized
    # as a cold serve sizes it (runner/kv_sizing.py), from the step's shapes plus the margin kept for
    # autotuning, which a deviceless compile does not run (the report's temp figures say whether the real
    # compiles fit it).
    budget: KVBudget | None = None
    estimate = temp_estimate(cfg, jax.tree.leaves(state), largest_buckets(todo))
    if facts.memory_bytes and config.cache.num_kv_pages is None:  # an explicit count wins, as in serve
        budget = KVBudget(facts.memory_bytes, config.cache.gpu_memory_utilization, weights_bytes, state_bytes,
                          with_margin(estimate), page_bytes)
        budget.check()
        num_pages = budget.num_pages
    else:
        num_pages = config.cache.num_kv_pages or pages_in_host_memory(config.cache.kv_cache_memory_gib, page_bytes, tp)
    if asked == AUTO_MAX_MODEL_LEN:  # as the runner fits it (model_runner.py)
        max_len = fit_to_kv_cache(max_len, num_pages, cache.page_size)
        max_pages_per_req = -(-max_len // cache.page_size)
    shapes = shapes_for(num_pages)

    reference_step = None
    if xla_cost:
        reference = build_abstract_model(hf_config, jax_dtype, AttentionConfig("reference"))
        reference_step = (make_step_fn(reference.graphdef, jax.tree.structure(reference.state),
                                       config.model.max_logprobs, pooling=pooling), reference.state)
    roofline_shape = model_shape(abstract.num_params, cfg)
    layer_itemsize = layer_weight_itemsize(quantization)  # (their scales: a rounding error)
    context = context_len or max_len // 2
    peak = facts.peak_flops_for(jnp.dtype(jax_dtype).name)

    def layer_peak(bucket: Bucket, variant: str) -> float | None:  # FP8 activations too: the FP8 peak
        dtype = None if variant.startswith("draft") else layer_matmul_dtype(state, bucket.num_tokens, attention)
        return facts.peak_flops_for(dtype) if dtype else None

    step_fns = {"plain": (step, False)}
    if variants and not pooling:
        treedef, max_logprobs = jax.tree.structure(abstract.state), config.model.max_logprobs
        if config.buckets.greedy_decodes:
            step_fns["greedy"] = (make_step_fn(abstract.graphdef, treedef, max_logprobs, mesh, greedy=True,
                                               compiler_options=options, feature_layers=feature_layers), False)
        if sched.num_scheduler_steps > 1:
            for greedy in (False, True):
                step_fns["multi-step greedy" if greedy else "multi-step"] = (make_decode_steps_fn(
                    abstract.graphdef, treedef, max_logprobs, sched.num_scheduler_steps, cache.page_size,
                    padding_slot(num_pages, cache.page_size), mesh, greedy, options,
                    feature_layers=feature_layers), True)
    jobs_todo = [(bucket, name) for bucket in todo for name in step_fns
                 if name == "plain" or (bucket.decode_only and (name != "multi-step greedy"
                                                                or config.buckets.greedy_decodes))]
    # The drafter's runner, as serve warms it up and runs it (greedy rows): the plain step in every bucket (its
    # catch-ups), the greedy one in the decode buckets, and a round's k - 1 decode steps in one call
    programs = dict.fromkeys(step_fns, (state, shapes, roofline_shape))
    if drafter is not None:
        draft_shapes = drafter.shapes(cache.page_size, num_pages, max_pages_per_req, sched.max_num_seqs, jax_dtype)
        draft_program = (drafter.state, draft_shapes, model_shape(drafter.num_params, drafter.cfg))
        draft_treedef = jax.tree.structure(drafter.state)
        step_fns["draft"] = (make_step_fn(drafter.graphdef, draft_treedef, 1, mesh, sample_apart=apart,
                                          compiler_options=options), False)
        step_fns["draft greedy"] = (make_step_fn(drafter.graphdef, draft_treedef, 1, mesh, greedy=True,
                                                 compiler_options=options), False)
        jobs_todo += ([(bucket, "draft") for bucket in todo]
                      + [(bucket, "draft greedy") for bucket in todo if bucket.decode_only])
        if (steps := speculative_config.num_speculative_tokens - 1) > 1:
            step_fns["draft multi-step"] = (make_decode_steps_fn(
                drafter.graphdef, draft_treedef, 1, steps, cache.page_size,
                padding_slot(num_pages, cache.page_size), mesh, True, options), True)
            jobs_todo += [(bucket, "draft multi-step") for bucket in todo if bucket.decode_only]
        programs |= dict.fromkeys(("draft", "draft greedy", "draft multi-step"), draft_program)
    if apart:  # one sampler per request bucket
        step_fns["sampler"] = (make_sample_fn(config.model.max_logprobs, sched.max_num_seqs, mesh, options), False)
        jobs_todo += [(Bucket(rows, rows, decode_only=True), "sampler") for rows in sorted({b.num_reqs for b in todo})]

    def one(job: tuple[Bucket, str]) -> BucketResult:
        bucket, variant = job
        step_fn, multi_step = step_fns[variant]
        with trace_time.measuring() as python:
            if variant == "sampler":
                compiled = compile_sampler(step_fn, shapes, bucket.num_reqs, device, mesh)
            else:
                program_state, program_shapes, _ = programs[variant]
                compiled = compile_bucket(step_fn, program_state, program_shapes, bucket, device, mesh,
                                          read_launches=read_launches, multi_step=multi_step)
        python_seconds = {"trace_seconds": round(python.trace_seconds, 3),
                          "lower_seconds": round(python.lower_seconds, 3)}
        if variant == "sampler":
            return _sampler_result(compiled, python_seconds)
        xla_flops = xla_bytes = None
        if reference_step is not None and variant == "plain":
            ref_step, ref_state = reference_step
            cpu = jax.devices("cpu")[0]
            cost = ref_step.trace(*abstract_step_args(ref_state, shapes, bucket, cpu)).lower().cost_analysis()
            if cost:
                xla_flops, xla_bytes = cost.get("flops"), cost.get("bytes accessed")
        predicted = step_cost(programs[variant][2], bucket.num_tokens, bucket.num_reqs, context, itemsize,
                              peak, facts.memory_bandwidth,
                              itemsize if variant.startswith("draft") else layer_itemsize,  # a drafter's unquantized
                              layer_peak(bucket, variant))
        if mesh is not None:  # one device's share would ignore the all-reduces: no prediction
            predicted = dataclasses.replace(predicted, compute_seconds=None, memory_seconds=None)
        logger.info("compiled %s (%s) in %.1fs", bucket, variant, compiled.compile_seconds)
        return BucketResult(
            num_tokens=bucket.num_tokens, num_reqs=bucket.num_reqs, decode_only=bucket.decode_only,
            compile_seconds=round(compiled.compile_seconds, 3), argument_bytes=compiled.argument_bytes,
            output_bytes=compiled.output_bytes, alias_bytes=compiled.alias_bytes, temp_bytes=compiled.temp_bytes,
            xla_flops=xla_flops, xla_bytes=xla_bytes, flops=predicted.flops, bytes=predicted.bytes,
            predicted_seconds=predicted.seconds, bound=predicted.bound,
            collectives=count_collectives(compiled.compiled.as_text()) if mesh is not None else {},
            launches=compiled.launches, variant=variant, **python_seconds,
        )

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        results = list(pool.map(one, jobs_todo))
    return CompileReport(
        model=name, device=facts.name, target=target, dtype=jnp.dtype(jax_dtype).name, attention=attention.impl,
        page_size=cache.page_size, kv_cache_dtype=cache_dtype.name, bytes_per_page=page_bytes,
        max_model_len=max_len, max_num_seqs=sched.max_num_seqs, context_len=context,
        jobs=jobs, tensor_parallel_size=tp, weights_bytes=weights_bytes, state_bytes=state_bytes,
        max_temp_bytes=max(r.temp_bytes for r in results), estimated_temp_bytes=estimate,
        gpu_memory_utilization=config.cache.gpu_memory_utilization,
        device_memory_bytes=facts.memory_bytes,
        kv_budget=budget, kv_budget_bytes=budget.kv_bytes if budget else None, num_kv_pages=num_pages,
        num_kv_pages_given=config.cache.num_kv_pages is not None,
        compile_seconds=round(sum(r.compile_seconds for r in results), 2),
        trace_seconds=round(sum(r.trace_seconds for r in results), 2),
        lower_seconds=round(sum(r.lower_seconds for r in results), 2),
        wall_seconds=round(time.perf_counter() - wall_start, 2),
        buckets=results,
    )


def _sampler_result(compiled: CompiledBucket, python_seconds: dict[str, float]) -> BucketResult:
    """A sampler's row (CPU targets): its compile and memory; no roofline, which counts whole steps."""
    logger.info("compiled the sampler of %d rows in %.1fs", compiled.bucket.num_reqs, compiled.compile_seconds)
    return BucketResult(
        num_tokens=compiled.bucket.num_tokens, num_reqs=compiled.bucket.num_reqs, decode_only=True,
        compile_seconds=round(compiled.compile_seconds, 3), argument_bytes=compiled.argument_bytes,
        output_bytes=compiled.output_bytes, alias_bytes=compiled.alias_bytes, temp_bytes=compiled.temp_bytes,
        xla_flops=None, xla_bytes=None, flops=0.0, bytes=0.0, predicted_seconds=None, bound=None, collectives={},
        launches=None, variant="sampler", **python_seconds,
    )


_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def count_collectives(hlo_text: str) -> dict[str, int]:
    """Cross-device ops in compiled HLO text, by kind (async pairs counted once, by their start)."""
    counts = {}
    for kind in _COLLECTIVES:
        found = len(re.findall(rf"\s{kind}(?:-start)?\(", hlo_text))
        if found:
            counts[kind] = found
    return counts


def format_report(report: CompileReport) -> str:
    """The per-bucket table and the totals, as `jaxserve compile` prints them."""
    mib, gib = 2**20, 2**30

    def num(value: float | None, scale: float, digits: int = 1) -> str:
        return "-" if value is None else f"{value / scale:.{digits}f}"

    header = (f"{'tokens':>6} {'reqs':>4} {'kind':<17} {'compile s':>9} {'arg MiB':>8} {'out MiB':>8} "
              f"{'temp MiB':>8} {'XLA GFLOP':>9} {'XLA GB':>7} {'GFLOP':>8} {'GB':>6} {'pred ms':>8} "
              f"{'tok/s':>9} bound")
    split = (f" x{report.tensor_parallel_size} (tensor parallel, memory per device)"
             if report.tensor_parallel_size > 1 else "")
    lines = [
        f"{report.model} on {report.device}{split} ({report.target or 'local device'}), {report.dtype}, "
        f"attention {report.attention}, max_model_len {report.max_model_len}, "
        f"roofline at {report.context_len} keys per request",
        header,
        "-" * len(header),
    ]
    for r in report.buckets:
        tok_s = r.num_tokens / r.predicted_seconds if r.predicted_seconds else None
        lines.append(
            f"{r.num_tokens:>6} {r.num_reqs:>4} {_kind(r):<17} "
            f"{r.compile_seconds:>9.1f} {num(r.argument_bytes, mib):>8} {num(r.output_bytes, mib):>8} "
            f"{num(r.temp_bytes, mib):>8} {num(r.xla_flops, 1e9):>9} {num(r.xla_bytes, 1e9, 2):>7} "
            f"{num(r.flops, 1e9):>8} {num(r.bytes, 1e9, 2):>6} {num(r.predicted_seconds, 1e-3, 3):>8} "
            f"{'-' if tok_s is None else f'{tok_s:,.0f}':>9} {r.bound or '-'}"
        )
    lines.append("")
    lines.append(_launch_table(report))
    if report.tensor_parallel_size > 1:
        lines.append("collectives per step: " + "; ".join(
            f"{r.num_tokens}x{r.num_reqs}{' decode' if r.decode_only else ''}: "
            + ", ".join(f"{n} {kind}" for kind, n in r.collectives.items()) for r in report.buckets))
    lines.append("")
    lines.append(f"{len(report.buckets)} steps compiled in {report.compile_seconds:.1f}s of compile time "
                 f"({report.wall_seconds:.1f}s wall, {report.jobs} job(s)); of it, jax traced for "
                 f"{report.trace_seconds:.1f}s and lowered for {report.lower_seconds:.1f}s (Python: one compile "
                 f"at a time)")
    lines.append(f"weights {report.weights_bytes / gib:.2f} GiB, other state {report.state_bytes / mib:.0f} MiB, "
                 f"largest temp allocation {report.max_temp_bytes / mib:.0f} MiB (estimated from the step's shapes: "
                 f"{report.estimated_temp_bytes / mib:.0f} MiB)")
    page = f"{report.page_size} tokens ({report.kv_cache_dtype}, {report.bytes_per_page / 2**10:,.0f} KiB)"
    if report.kv_budget_bytes is not None and report.device_memory_bytes:
        tokens = report.num_kv_pages * report.page_size
        lines.append(
            f"KV budget at --gpu-memory-utilization {report.gpu_memory_utilization}: "
            f"{report.kv_budget_bytes / gib:.2f} GiB of {report.device_memory_bytes / gib:.1f} GiB = "
            f"{report.num_kv_pages:,} pages of {page} = {tokens:,} tokens"
        )
        if report.kv_budget is not None and report.max_temp_bytes > report.kv_budget.peak_temp_bytes:
            lines.append(f"  (the compiled temp memory is over the {report.kv_budget.peak_temp_bytes / mib:.0f} MiB "
                         "the estimate kept: serve sizes the cache again from the compiled figure)")
    else:  # an explicit --num-kv-pages, or a CPU's --kv-cache-memory
        how = "--num-kv-pages" if report.num_kv_pages_given else "the CPU budget"
        lines.append(f"KV cache: {report.num_kv_pages:,} pages of {page} ({how})")
    return "\n".join(lines)


def _kind(result: BucketResult) -> str:
    """A row's step: mixed or decode, a decode bucket's variant, or a drafter's plain step (mixed or decode) or
    variant."""
    shape = "decode" if result.decode_only else "mixed"
    if result.variant == "draft":  # the drafter's plain step
        return f"draft {shape}"
    return shape if result.variant == "plain" else result.variant


def _launch_table(report: CompileReport) -> str:
    """Per bucket: the dispatch's arguments; what the host issues one by one per step (command buffers, each
    one graph launch, and what lies between them: conditionals and loops, each a host sync, kernels,
    copies); the kernels in all, and how many command buffers record."""
    header = (f"{'tokens':>6} {'reqs':>4} {'kind':<17} {'args':>5} {'host ops':>8} {'syncs':>5} {'kernels':>7} "
              f"{'in graphs':>9}  host ops by kind")
    lines = ["launches per step (XLA's thunks):", header, "-" * len(header)]
    for r in report.buckets:
        launches = r.launches
        if launches is None:
            return "launches per step: only GPU targets have thunks to read"
        kinds = ", ".join(f"{n} {kind[1:]}" for kind, n in launches.host_ops.items())
        lines.append(
            f"{r.num_tokens:>6} {r.num_reqs:>4} {_kind(r):<17} "
            f"{launches.num_arguments:>5} {launches.num_host_ops:>8} {launches.host_syncs:>5} "
            f"{launches.num_kernels:>7} {launches.graph_share:>9.0%}  {kinds}")
    return "\n".join(lines)
