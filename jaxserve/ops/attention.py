"""The one attention entry point the models call; `impl` picks the implementation.

- `reference`: the plain jnp path (`paged_attention_ref`), the readable oracle for the others.
- `cpu`: the jnp path for XLA:CPU (`paged_attention_cpu`): queries in blocks that share each K/V read.
- `cpu-native`: a C++ kernel built for this machine (`cpu_kernels`) that walks each request's pages in
  place, with work that follows the live tokens rather than the bucket's shape. A bfloat16 model's
  matmuls then run in the same library (`AttentionConfig.native_matmuls`).
- `pallas`: the Pallas kernels for CUDA GPUs, sm_80 and newer: Triton's (`paged_attention_pallas`), and on
  Hopper (sm_90) Mosaic GPU's for prefill and mixed steps (`paged_attention_mgpu`: TMA, wgmma) where the
  shapes fit it (a 16-bit cache, or an FP8 one with JAXSERVE_MOSAIC_FP8=1; head dim a multiple of 64,
  pages of a multiple of 8 tokens).
- `interpret`: the same kernel run by Pallas' interpreter, so CPU tests exercise its indexing and masking.
- `auto`: `pallas` on a CUDA GPU with compute capability >= 8.0; on a CPU `cpu-native`, or `cpu` when the
  kernel cannot be built here (no C++ compiler); `reference` elsewhere.

Pallas' Triton backend is deprecated. With a jax that has dropped it, Hopper keeps `pallas` (the Mosaic GPU
kernel where the shapes fit it, XLA's reference path for the rest), other CUDA GPUs get `reference` from `auto`
with one warning, and `pallas` there, or `interpret` anywhere, is refused with the reason.

The choice is made once, against the device the step is compiled for (`jaxserve.device.DeviceFacts`: the
local one, or a GPU target when compiling without a GPU), and travels in the model config as an
`AttentionConfig` with the SM count the decode kernel sizes its splits by.
"""

import functools
import logging
import os
from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp
import jaxlib.version

from jaxserve.config import ATTENTION_IMPLS  # the one list; the CLI reads it without importing jax
from jaxserve.device import DeviceFacts, local_facts
from jaxserve.ops import cpu_kernels, fp8_block_matmul, paged_attention_pallas
from jaxserve.ops.head_groups import in_group_parts
from jaxserve.ops.paged_attention_cpu import ragged_paged_attention_cpu
from jaxserve.ops.paged_attention_ref import ragged_paged_attention_reference

logger = logging.getLogger(__name__)

AttentionImpl = Literal["auto", "reference", "cpu", "cpu-native", "pallas", "interpret"]
MIN_PALLAS_COMPUTE_CAPABILITY = 8.0
# Whether this jaxlib's XLA records Mosaic GPU custom calls in command buffers (0.12 does; 0.11 does not:
# docs/benchmarks.md, the deviceless Llama-3-8B compile's host operations). XLA is jaxlib's, and jax 0.12
# accepts jaxlib 0.11.2.
MOSAIC_IN_COMMAND_BUFFERS = jaxlib.version.__version_info__ >= (0, 12)

# Every implementation reads the same page layout, so a cache can be checked against either.
kv_cache_shape = paged_attention_pallas.kv_cache_shape
# vLLM's names for an FP8 cache: e4m3, the dtype the Pallas kernels widen in registers.
FP8_KV_CACHE_DTYPES = dict.fromkeys(("fp8", "fp8_e4m3"), paged_attention_pallas.FP8_CACHE_DTYPES[0])


# The environment the kernel choices below read while a step is traced: part of the key of anything that
# keeps a traced step (`runner.step_fn`).
TRACE_ENVIRONMENT = ("JAXSERVE_MOSAIC_ATTENTION", "JAXSERVE_MOSAIC_DECODE", "JAXSERVE_MOSAIC_PERSISTENT",
                     "JAXSERVE_MOSAIC_FP8", "JAXSERVE_TRITON_EXPERTS", "JAXSERVE_FP8_ACTIVATIONS",
                     "JAXSERVE_MOSAIC_FP8_BLOCK")


def trace_environment() -> tuple[str | None, ...]:
    """TRACE_ENVIRONMENT's values now: part of the key of a kept trace."""
    return tuple(os.environ.get(name) for name in TRACE_ENVIRONMENT)


@dataclass(frozen=True)
class AttentionConfig:
    """A resolved attention choice (part of the model config, so of the compile key)."""

    impl: str = "reference"  # reference | cpu | cpu-native | pallas | interpret, never auto
    num_sms: int | None = None  # the target's SM count; the decode kernel's split count follows it
    compute_capability: float | None = None  # the target's (CUDA GPUs): whether it reads an FP8 cache
    mesh: Any = None  # jax.sharding.Mesh with tensor parallelism: attention runs per shard of KV heads

    @property
    def cuda(self) -> bool:
        """Whether the step is compiled for a CUDA GPU (a real one, or a target compiled for without one)."""
        return self.compute_capability is not None

    @property
    def hopper(self) -> bool:
        """Whether the step is compiled for a Hopper GPU (sm_90), the target of the Mosaic GPU kernels
        (wgmma is sm_90's; Blackwell's tensor cores take other instructions)."""
        return self.impl == "pallas" and self.compute_capability is not None and 9.0 <= self.compute_capability < 10.0

    @property
    def mosaic_attention(self) -> bool:
        """Whether prefill and mixed steps may take the Mosaic GPU attention kernel: on Hopper, unless
        JAXSERVE_MOSAIC_ATTENTION=0 keeps every step on the Triton kernels (to compare the two)."""
        return self.hopper and os.environ.get("JAXSERVE_MOSAIC_ATTENTION", "1") != "0"

    @property
    def mosaic_decode(self) -> bool:
        """Whether decode-only steps take the Mosaic GPU kernel instead of the split-KV Triton kernel. On
        Hopper it read K/V 1.4-1.5x faster on an H200 (docs/benchmarks.md), so it does by default with jaxlib
        >= 0.12, whose XLA keeps Mosaic GPU calls inside command buffers; before, each call splits the step's
        (a Llama-3-8B decode step: 73 host operations instead of 6), which costs most at small batches.
        JAXSERVE_MOSAIC_DECODE=1 or 0 decides either way."""
        setting = os.environ.get("JAXSERVE_MOSAIC_DECODE")
        if setting is not None:
            return self.hopper and setting == "1"
        return self.hopper and MOSAIC_IN_COMMAND_BUFFERS

    @property
    def mosaic_persistent(self) -> bool:
        """Whether the Mosaic GPU kernel runs on a persistent grid (`paged_attention_mgpu`, "Work split":
        a program a multiprocessor, each walking several query blocks or requests): with
        JAXSERVE_MOSAIC_PERSISTENT=1, until a GPU has measured it against a program a block."""
        return self.hopper and self.num_sms is not None and os.environ.get("JAXSERVE_MOSAIC_PERSISTENT") == "1"

    @property
    def mosaic_fp8(self) -> bool:
        """Whether the Mosaic GPU kernel reads an FP8 cache (widening its stages in shared memory:
        `paged_attention_mgpu`), rather than leaving such steps to the Triton kernels: with
        JAXSERVE_MOSAIC_FP8=1, until a Hopper GPU has run it against the oracle and measured it."""
        return self.hopper and os.environ.get("JAXSERVE_MOSAIC_FP8") == "1"

    @property
    def fp8_kernels(self) -> str | None:
        """How the kernels that read FP8 weights in registers run (`ops.fp8_block_matmul`,
        `ops.grouped_matmul_triton`) where their shapes fit: "compiled" on CUDA GPUs whose Triton converts e4m3
        in hardware (sm_89 and later), "interpret" with the interpreted kernels (tests), None elsewhere (XLA,
        over the widened weights)."""
        if self.impl == "interpret":
            return "interpret"
        fast = self.impl == "pallas" and (self.compute_capability or 0) >= fp8_block_matmul.MIN_COMPUTE_CAPABILITY
        return "compiled" if fast and fp8_block_matmul.TRITON_BACKEND else None

    @property
    def fp8_block_kernel(self) -> str | None:
        """`fp8_kernels` for the dense layers' block-scaled products, on one device: under a mesh those run
        under XLA's partitioner, which cannot split a kernel (the experts' kernel runs under `shard_map`)."""
        return None if self.mesh is not None else self.fp8_kernels

    @property
    def fp8_block_mosaic(self) -> str | None:
        """How block-scaled FP8 weights' steps of e4m3 rows run on Hopper's FP8 wgmma through the Mosaic GPU
        kernel (`ops.fp8_block_matmul_mgpu`), the weights stored K-major for it (`fp8_layout.kernel_layout`):
        with JAXSERVE_MOSAIC_FP8_BLOCK=1 where the block kernel runs (`fp8_block_kernel`) with FP8 activations,
        "compiled" on Hopper, "interpret" with the interpreted kernels (tests); None elsewhere. Until a Hopper
        GPU has run it against the oracle and measured it, Hopper keeps the Triton kernel by default."""
        if os.environ.get("JAXSERVE_MOSAIC_FP8_BLOCK") != "1" or not self.fp8_activations:
            return None
        mode = self.fp8_block_kernel
        if mode == "interpret" or (mode == "compiled" and self.hopper):
            return mode
        return None

    @property
    def expert_kernel(self) -> str | None:
        """How a mixture's 16-bit experts' grouped matmuls run through `ops.grouped_matmul_triton` where their
        shapes fit (and Hopper's Mosaic GPU kernel does not take them): "compiled" on CUDA GPUs of sm_80 and
        later, "interpret" with the interpreted kernels, None elsewhere (XLA's ragged dot).
        JAXSERVE_TRITON_EXPERTS=0 keeps them, and FP8 experts (`fp8_expert_kernel`), on XLA's paths."""
        if os.environ.get("JAXSERVE_TRITON_EXPERTS") == "0":
            return None
        if self.impl == "interpret":
            return "interpret"
        fast = self.impl == "pallas" and (self.compute_capability or 0) >= MIN_PALLAS_COMPUTE_CAPABILITY
        return "compiled" if fast and fp8_block_matmul.TRITON_BACKEND else None

    @property
    def fp8_expert_kernel(self) -> str | None:
        """`fp8_kernels` for a mixture's FP8 experts (`ops.grouped_matmul_triton`, under `shard_map` on a mesh
        too), unless JAXSERVE_TRITON_EXPERTS=0."""
        return None if os.environ.get("JAXSERVE_TRITON_EXPERTS") == "0" else self.fp8_kernels

    @property
    def fp8_activations(self) -> bool:
        """Whether FP8 weights with a scale per output channel (or per tensor) multiply activations rounded to
        e4m3 as well, a scale per token (W8A8, vLLM's dynamic scheme for such weights), in steps of
        `quantization.W8A8_MIN_ROWS` rows or more: on CUDA GPUs with FP8 tensor cores (sm_89 on), whose GEMMs
        then run at twice their 16-bit rate. Block-scaled weights and experts take them where their Triton
        kernels run e4m3 dots on those too (`fp8_block_activations`, `fp8_expert_activations`).
        JAXSERVE_FP8_ACTIVATIONS=0 or 1 decides either way (1 on a CPU gives a GPU's numerics, to measure their
        accuracy)."""
        setting = os.environ.get("JAXSERVE_FP8_ACTIVATIONS")
        if setting is not None:
            return setting == "1"
        return self.impl == "pallas" and (self.compute_capability or 0) >= MIN_FP8_COMPUTE_CAPABILITY

    @property
    def fp8_block_activations(self) -> bool:
        """Whether block-scaled FP8 weights meet activations in e4m3 too, where `fp8_activations` and the block
        kernel (`fp8_block_kernel`) runs, which takes them with a scale per row and block (the weight's):
        interpreted, or compiled where its e4m3 dot runs on FP8 tensor cores
        (`fp8_block_matmul.FP8_MMA_COMPUTE_CAPABILITIES`: Ada). JAXSERVE_FP8_ACTIVATIONS=1 takes them on any
        GPU the kernel runs on (a Hopper GPU, to measure what its float16 MMAs cost)."""
        return self._fp8_rows(self.fp8_block_kernel)

    @property
    def fp8_expert_activations(self) -> bool:
        """`fp8_block_activations` for a mixture's FP8 experts, where their kernel runs (`fp8_expert_kernel`,
        under `shard_map` on a mesh too), for a scale per channel or per block alike."""
        return self._fp8_rows(self.fp8_expert_kernel)

    def _fp8_rows(self, kernel_mode: str | None) -> bool:
        """Whether a Triton kernel running in `kernel_mode` takes e4m3 rows (`fp8_block_activations`)."""
        if kernel_mode is None or not self.fp8_activations:
            return False
        return (kernel_mode == "interpret" or os.environ.get("JAXSERVE_FP8_ACTIVATIONS") == "1"
                or self.compute_capability in fp8_block_matmul.FP8_MMA_COMPUTE_CAPABILITIES)

    @property
    def native_matmuls(self) -> bool:
        """Whether bfloat16 matmuls go through the native CPU kernel too (`cpu_kernels.matmul_bf16`): with
        `cpu-native` on one device. XLA:CPU runs bfloat16 dots several times slower than float32 ones."""
        return self.impl == "cpu-native" and self.mesh is None


def cuda_compute_capability(device: Any = None) -> float | None:
    """The device's CUDA compute capability (9.0 on an H100), or None for CPUs and non-CUDA GPUs."""
    return local_facts(device).compute_capability


def resolve_impl(impl: str, device: DeviceFacts | None = None, kv_cache_dtype: str = "auto") -> str:
    """Maps `auto` to a concrete implementation for `device` (the local default one) and checks the choice.
    On a CPU `auto` is the native kernel, or the jnp `cpu` path for an FP8 cache, which the kernel cannot read."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; choose from {', '.join(ATTENTION_IMPLS)}")
    if impl == "interpret" and (backend_gone := paged_attention_pallas.missing_backend()) is not None:
        raise ValueError(f"attention impl 'interpret' runs the Triton kernels: {backend_gone}")
    if impl not in ("auto", "pallas", "cpu-native"):
        return impl
    device = device or local_facts()
    if impl == "cpu-native":
        if device.platform != "cpu":
            raise ValueError(f"attention impl 'cpu-native' runs on CPUs, not on {device.platform}")
        if (error := cpu_kernels.kernel_error()) is not None:
            raise ValueError(f"attention impl 'cpu-native' is unavailable here: {error}; use 'cpu'")
        return impl
    capability = device.compute_capability
    kernel_runs = capability is not None and capability >= MIN_PALLAS_COMPUTE_CAPABILITY
    # Without Triton's backend only Hopper's Mosaic GPU kernel is left (AttentionConfig.hopper).
    backend_gone = paged_attention_pallas.missing_backend()
    kernels_here = kernel_runs and (backend_gone is None or 9.0 <= capability < 10.0)
    if impl == "auto":
        if kernels_here:
            return "pallas"
        if kernel_runs:
            _warn_kernels_missing(f"{backend_gone}: attention on compute capability {capability} runs through "
                                  "XLA (the reference path)")
            return "reference"
        if device.platform == "cpu":
            native = cpu_kernels.kernel_error() is None and kv_cache_dtype not in FP8_KV_CACHE_DTYPES
            return "cpu-native" if native else "cpu"
        return "reference"
    if impl == "pallas" and kernel_runs and not kernels_here:
        raise ValueError(f"attention impl 'pallas' on compute capability {capability}: {backend_gone}; "
                         "use 'reference' (or a jax that has the backend)")
    if impl == "pallas" and not kernel_runs:
        found = f"compute capability {capability}" if capability is not None else "no CUDA GPU"
        raise ValueError(
            f"attention impl 'pallas' needs a CUDA GPU with compute capability >= "
            f"{MIN_PALLAS_COMPUTE_CAPABILITY} ({found} here); use 'cpu', or 'interpret' to run the kernel "
            "slowly on CPU"
        )
    return impl


@functools.cache  # once a process, whatever resolves attention how often
def _warn_kernels_missing(message: str) -> None:
    logger.warning(message)


MIN_FP8_COMPUTE_CAPABILITY = 8.9  # Ada and Hopper convert e4m3 in hardware (Triton's fp8e4nv)


def kv_cache_dtype(requested: str, model_dtype: Any, impl: str, compute_capability: float | None = None) -> Any:
    """The KV cache's dtype: `requested` (`auto`: the model's). The Pallas kernel takes queries in the model's
    dtype and reads a cache of that dtype or FP8 (widened in registers, on GPUs of compute capability
    >= 8.9); the jnp paths read any; the native CPU kernel reads 16- and 32-bit caches."""
    model_dtype = jnp.dtype(model_dtype)
    fp8 = requested in FP8_KV_CACHE_DTYPES
    dtype = model_dtype if requested == "auto" else jnp.dtype(FP8_KV_CACHE_DTYPES.get(requested, requested))
    if fp8 and impl == "cpu-native":
        raise ValueError(f"kv_cache_dtype {requested}: attention impl 'cpu-native' reads 16- and 32-bit caches; "
                         "use --attention cpu (or reference) for an FP8 cache on a CPU")
    if fp8 and impl == "pallas" and (compute_capability or 0.0) < MIN_FP8_COMPUTE_CAPABILITY:
        raise ValueError(f"kv_cache_dtype {requested} needs a GPU of compute capability >= "
                         f"{MIN_FP8_COMPUTE_CAPABILITY} (FP8 conversions in hardware), not {compute_capability}")
    if impl in ("pallas", "interpret") and dtype != model_dtype and not fp8:
        raise ValueError(f"kv_cache_dtype {requested} differs from the model's dtype ({model_dtype.name}), which "
                         f"attention impl {impl!r} needs (or fp8); use auto, fp8, or a CPU attention impl")
    return dtype


def resolve_attention(impl: str, device: DeviceFacts | None = None, kv_cache_dtype: str = "auto") -> AttentionConfig:
    """The attention config for the device the step is compiled for (the local default one if None)."""
    device = device or local_facts()
    return AttentionConfig(impl=resolve_impl(impl, device, kv_cache_dtype), num_sms=device.num_sms,
                           compute_capability=device.compute_capability)


def ragged_paged_attention(
    q: jax.Array,  # [T, N, H]
    k_pages: jax.Array,  # [K, num_pages, page_size, H]
    v_pages: jax.Array | None,  # [K, num_pages, page_size, H]; None: the values are the keys
    kv_lens: jax.Array,  # i32[R]
    page_table: jax.Array,  # i32[R, P]
    cu_q_lens: jax.Array,  # i32[R+1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: jax.Array | None = None,  # f32[N]
    impl: str = "auto",
    num_sms: int | None = None,
    decode_only: bool = False,
    hopper: bool = False,
    hopper_decode: bool = False,
    persistent: bool = False,
    hopper_fp8: bool = False,
    value_dims: int | None = None,
) -> jax.Array:  # [T, N, Hv]: Hv is value_dims, or H
    """Causal attention of packed ragged queries over each request's paged K/V.

    Request r's queries are tokens `cu_q_lens[r]:cu_q_lens[r+1]`, the last positions of its `kv_lens[r]`
    cached tokens; its pages are `page_table[r, :ceil(kv_lens[r] / page_size)]`. Tokens past
    `cu_q_lens[-1]` are padding and come back as zeros.

    `sliding_window` (static): a query at position p sees only keys p - sliding_window + 1 .. p, and no
    implementation reads the pages before that but the Mosaic GPU kernel, which loads whole blocks of
    keys (their slots must then hold finite values, as the engine's do) and masks the keys outside.
    `logit_softcap` (static): scaled scores s become cap * tanh(s / cap) before the softmax (Gemma 2).
    `sinks`: each query head's attention-sink logit (GPT-OSS), added to the softmax's denominator as a key
    that weighs no value; every path takes them.
    `v_pages` None: each key is also its value (DeepSeek's latent cache, `models.values_are_keys`); the
    Triton kernels then load each block once for both products, the other paths read the keys' pages as values.
    `value_dims` (static, with `v_pages` None): the values are the keys' first `value_dims` dims, and the output
    is that wide (DeepSeek's latent, without the RoPE key); the Triton kernels then hold the head in two pieces
    where both are powers of two (`paged_attention_pallas.HeadPieces`), the other paths drop the rest at the end.

    `decode_only` (static) promises that token r is request r's only query (T == R; padding requests
    have kv_len 0), which lets the kernel split long contexts across programs into about two waves of
    `num_sms` programs. `impl` is taken as resolved (`auto` is resolved against the local device).
    `hopper` (static, with `pallas`): the target is a Hopper GPU, whose prefill and mixed steps go through
    the Mosaic GPU kernel where the shapes fit it; `hopper_decode` (static) sends decode-only steps there
    too (`AttentionConfig.mosaic_decode`); `persistent` (static): the Mosaic GPU kernel on a persistent
    grid of `num_sms` programs over the KV heads (`AttentionConfig.mosaic_persistent`); `hopper_fp8`
    (static): an FP8 cache takes the Mosaic GPU kernel too (`AttentionConfig.mosaic_fp8`), else the Triton ones.
    """
    if impl == "auto":
        impl = resolve_impl(impl)
    if value_dims is not None and v_pages is not None:
        raise ValueError("value_dims: the values are the keys' first dims, with v_pages None")
    scores = dict(sm_scale=sm_scale, sliding_window=sliding_window, logit_softcap=logit_softcap)
    if sinks is not None:
        scores["sinks"] = sinks
    if impl == "cpu-native":  # reads each block of keys once for both products, sums only the values' dims
        return cpu_kernels.ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, **scores,
                                                  value_dims=value_dims)
    # The paths that read values from pages of their own; they attend over whole heads, and `[..., :value_dims]`
    # keeps the values' dims (a no-op without value_dims).
    values = k_pages if v_pages is None else v_pages
    if impl == "cpu":
        out = ragged_paged_attention_cpu(
            q, k_pages, values, kv_lens, page_table, cu_q_lens, decode_only=decode_only, **scores
        )
        return out[..., :value_dims]
    if impl == "reference":
        out = ragged_paged_attention_reference(q, k_pages, values, kv_lens, page_table, cu_q_lens, **scores)
        return out[..., :value_dims]
    interpret = impl == "interpret"
    fp8_cache = k_pages.dtype in paged_attention_pallas.FP8_CACHE_DTYPES
    if (hopper_decode if decode_only else hopper) and not interpret and (hopper_fp8 or not fp8_cache):
        from jaxserve.ops import paged_attention_mgpu as mgpu

        shape = (q.dtype, k_pages.dtype, q.shape[1], k_pages.shape[0], q.shape[2], k_pages.shape[2])
        if (config := mgpu.config_for(decode_only, *shape, persistent=persistent)) is not None:
            args = (q, k_pages, values, kv_lens, page_table, cu_q_lens)
            programs = mgpu.one_wave(num_sms, k_pages.shape[0]) if persistent and num_sms else None  # this device's
            if decode_only:  # dealt longest first on a persistent grid (a snake of the launch order)
                out = mgpu.ragged_paged_attention_mgpu(*args, **config, **scores, programs_per_kv_head=programs,
                                                       heavy_first=mgpu.DECODE_HEAVY_FIRST or programs is not None)
            else:
                out = mgpu.ragged_paged_attention_hopper(*args, **scores, programs_per_kv_head=programs)
            return out[..., :value_dims]
    settings = paged_attention_pallas.block_settings(q.shape[2], decode_only)
    group = q.shape[1] // k_pages.shape[0]
    triton_here = interpret or paged_attention_pallas.TRITON_BACKEND  # interpreted, it says why it cannot run
    if not triton_here:  # a Hopper step the Mosaic GPU kernel does not take (an FP8 cache, decodes on jaxlib < 0.12)
        _warn_kernels_missing(f"{paged_attention_pallas.missing_backend()}: steps the Mosaic GPU kernel does not "
                              "take run through XLA (the reference path)")
    if not triton_here or settings is None or (settings and group > paged_attention_pallas.MAX_WIDE_GROUP
                                               and group % paged_attention_pallas.MAX_WIDE_GROUP):
        out = ragged_paged_attention_reference(q, k_pages, values, kv_lens, page_table, cu_q_lens, **scores)
        return out[..., :value_dims]

    def triton(q: jax.Array, sinks: jax.Array | None) -> jax.Array:  # (sinks: these heads')
        kwargs = {**scores, **settings, "sinks": sinks, "interpret": interpret, "value_dims": value_dims}
        if decode_only:
            return paged_attention_pallas.paged_decode_attention_pallas(
                q, k_pages, v_pages, kv_lens, page_table, num_sms=num_sms, **kwargs)
        return paged_attention_pallas.ragged_paged_attention_pallas(
            q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, **kwargs)

    if settings and group > paged_attention_pallas.MAX_WIDE_GROUP:  # wide heads: a part of the group a call
        return in_group_parts(triton, q, k_pages.shape[0], paged_attention_pallas.MAX_WIDE_GROUP, sinks)
    return triton(q, sinks)
