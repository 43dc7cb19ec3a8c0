"""Attention on a Hopper GPU: the Triton kernels' tuning space and the tensor-core candidates, side by side.

Four parts, each case checked against the jnp reference on the same shuffled paged cache (Llama-3-8B
heads, bfloat16):

1. **decode**: `paged_decode_attention_pallas` over page size x block_kv x num_warps x num_stages, on the
   case measured at 27% of HBM bandwidth on an H200 (256 requests, 200-2,048 keys each) and on 64 requests
   at 4,096 keys; reported in TB/s of K/V read and as a fraction of the device's HBM bandwidth.
2. **prefill/mixed**: `ragged_paged_attention_pallas` over block_rows x block_kv x num_warps x num_stages,
   on single chunks of 512-2,048 tokens at 2k-8k context and on a 1,024-token chunk beside 63 decodes;
   reported in TFLOP/s of useful attention (causal keys only) and as a fraction of the dense bf16 peak.
3. **paged**: jaxserve's own Mosaic GPU kernel (`ragged_paged_attention_mgpu`: TMA page loads, wgmma,
   a producer and one or two consumer warpgroups) on the mixed part's cases, over consumers x block_kv x
   stages x P in registers x the ping-pong schedule x the overlapped softmax (each configuration on every
   case before the next, the default first), in TFLOP/s of useful attention, side by side with part 2's Triton figures
   (`--parts paged-prefill`: these alone); and on part 1's decode cases at pages of 16, 32 and 64 tokens,
   in TB/s, beside the Triton decode kernel's defaults (`--parts paged-decode`: these alone).
4. **tensor-core candidates** for a chunk: the chunk's causal block through JAX's Mosaic GPU flash
   attention (`jax.experimental.pallas.ops.gpu.attention_mgpu`, TMA + wgmma), the keys before the chunk
   gathered from their pages and attended by the same kernel without a mask, the two merged by their
   log-sum-exp; and, for a chunk with no prefix, cuDNN's fused attention (`jax.nn.dot_product_attention`).

Each configuration is timed after its compile; a configuration that fails to compile or run is reported
with its error and the sweep goes on. `--budget-s` stops a part early rather than losing the report.

    python benchmarks/attention_sweep.py --out DIR               # on a GPU (about 1-2 minutes)
    python benchmarks/attention_sweep.py --out DIR --cpu         # here: tiny cases, kernels in interpret mode
"""

import argparse
import functools
import itertools
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from attention import HEADS, PagedInputs, build_inputs, paged_fn, peak_bandwidth, time_per_call

from jaxserve.ops.paged_attention_mgpu import (
    config_for,
    one_wave,
    ragged_paged_attention_hopper,
    ragged_paged_attention_mgpu,
    supports,
)
from jaxserve.ops.paged_attention_pallas import paged_decode_attention_pallas, ragged_paged_attention_pallas

PARTS = ("decode", "mixed", "paged", "paged-prefill", "paged-decode", "chunk")
FP8 = jnp.float8_e4m3fn
PEAK_BF16_FLOPS = [("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("A100", 312e12)]


@dataclass
class Result:
    part: str
    case: str
    impl: str
    config: str
    us: float | None
    rate: float | None  # TB/s (decode) or TFLOP/s (prefill)
    fraction: float | None
    max_abs_err: float | None
    error: str | None = None


def peak_flops(device: jax.Device) -> float | None:
    return next((p for name, p in PEAK_BF16_FLOPS if name.lower() in device.device_kind.lower()), None)


def useful_flops(inputs: PagedInputs, num_q_heads: int, head_dim: int) -> float:
    """4 * d * heads per (query, visible key) pair: QK^T and PV, causal keys only."""
    pairs = 0
    for q_len, kv_len in zip(inputs.q_lens, np.asarray(inputs.kv_lens).tolist(), strict=False):
        first = kv_len - q_len  # the chunk's first query sees first + 1 keys
        pairs += q_len * first + q_len * (q_len + 1) // 2
    return 4.0 * pairs * head_dim * num_q_heads


def measure(part: str, case: str, impl: str, config: str, fn: Callable, args: tuple, reference: np.ndarray,
            amount: float, peak: float | None, iters: int, unit: float) -> Result:
    try:
        out = jax.block_until_ready(fn(*args))
        err = float(np.abs(np.asarray(out.astype(jnp.float32)) - reference).max())
        seconds = time_per_call(fn, args, iters, calls_per_sample=5)
        rate = amount / seconds
        return Result(part, case, impl, config, seconds * 1e6, rate / unit, rate / peak if peak else None, err)
    except Exception as e:  # a configuration that does not compile (shared memory, registers) is a finding
        return Result(part, case, impl, config, None, None, None, None,
                      f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")


def mgpu_chunk_fn(inputs: PagedInputs, chunk_k: jax.Array, chunk_v: jax.Array, sm_scale: float,
                  block_q: int, block_kv: int, dtype, steps: int = 2) -> Callable:
    """One request's chunk of T queries at context C: causal self block + unmasked prefix, merged by LSE."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu as mgpu

    (q_len,), kv_len = inputs.q_lens, int(np.asarray(inputs.kv_lens)[0])
    prefix = kv_len - q_len
    num_kv_heads, _, page_size, head_dim = inputs.k_pages.shape
    prefix_pages = inputs.page_table[0, : prefix // page_size]
    causal = mgpu.TuningConfig(block_q=block_q, block_kv=block_kv, max_concurrent_steps=steps, causal=True)
    plain = mgpu.TuningConfig(block_q=block_q, block_kv=block_kv, max_concurrent_steps=steps, causal=False)

    def contiguous(pages: jax.Array) -> jax.Array:  # [K, P, page, H] -> [1, prefix, K, H]
        return pages[:, prefix_pages].reshape(num_kv_heads, prefix, head_dim).transpose(1, 0, 2)[None]

    def fn(q, k_pages, v_pages, chunk_k, chunk_v):  # q [T, N, H]; chunk_k/v [T, K, H]
        q = (q * sm_scale).astype(dtype)[None]  # the kernel does not scale
        out_self, (lse_self,) = mgpu.attention(q, chunk_k[None].astype(dtype), chunk_v[None].astype(dtype),
                                               causal, save_residuals=True)  # lse: [1, N, T], log2
        if not prefix:
            return out_self[0]
        out_prefix, (lse_prefix,) = mgpu.attention(q, contiguous(k_pages).astype(dtype),
                                                   contiguous(v_pages).astype(dtype), plain, save_residuals=True)
        lse = jnp.maximum(lse_self, lse_prefix)
        w_self, w_prefix = jnp.exp2(lse_self - lse), jnp.exp2(lse_prefix - lse)  # [1, N, T]
        w_self, w_prefix = (w.transpose(0, 2, 1)[..., None] for w in (w_self, w_prefix))  # [1, T, N, 1]
        out = (w_self * out_self.astype(jnp.float32) + w_prefix * out_prefix.astype(jnp.float32))
        return (out / (w_self + w_prefix))[0].astype(q.dtype)

    return jax.jit(fn), (inputs.q, inputs.k_pages, inputs.v_pages, chunk_k, chunk_v)


def chunk_kv(inputs: PagedInputs) -> tuple[jax.Array, jax.Array]:
    """The chunk's own K/V as the step has them (contiguous [T, K, H]), read back from its pages."""
    (q_len,), kv_len = inputs.q_lens, int(np.asarray(inputs.kv_lens)[0])
    num_kv_heads, _, page_size, head_dim = inputs.k_pages.shape
    pages = np.asarray(inputs.page_table[0, : -(-kv_len // page_size)])

    def take(p):
        flat = p[:, pages].reshape(num_kv_heads, -1, head_dim)[:, kv_len - q_len : kv_len]
        return flat.transpose(1, 0, 2)

    return take(inputs.k_pages), take(inputs.v_pages)


def cudnn_fn(sm_scale: float) -> Callable:
    def fn(q, k, v):  # one request, no prefix: [T, N, H], [T, K, H]
        return jax.nn.dot_product_attention(q[None], k[None], v[None], scale=sm_scale, is_causal=True,
                                            implementation="cudnn")[0]

    return jax.jit(fn)


def mgpu_config(num_consumers: int, block_kv: int, stages: int, in_registers: bool, *, ping_pong: bool = False,
                overlap: bool = False, heavy_first: bool = True, programs_per_kv_head: int | None = None) -> dict:
    """One configuration of `ragged_paged_attention_mgpu`: its keywords, in the order the report names them
    (a persistent grid's programs last, where there is one)."""
    config = dict(num_consumers=num_consumers, block_kv=block_kv, stages=stages, p_in_registers=in_registers,
                  ping_pong=ping_pong, overlap=overlap, heavy_first=heavy_first)
    return config if programs_per_kv_head is None else {**config, "programs_per_kv_head": programs_per_kv_head}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--name", default="attention_sweep", help="the report's file name in --out, less .json")
    parser.add_argument("--cpu", action="store_true", help="tiny cases, Pallas in interpret mode")
    parser.add_argument("--budget-s", type=float, default=150.0)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--focus", action="store_true",
                        help="only the decode defaults against the sweep's best, bfloat16 and FP8 caches, "
                             "interleaved over --rounds; and the mixed case in both cache dtypes")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--parts", nargs="+", choices=PARTS,
                        default=[p for p in PARTS if p not in ("paged-prefill", "paged-decode")],
                        help="which parts to run (paged-prefill, paged-decode: the paged part's mixed or decode "
                             "cases alone)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    device = jax.devices()[0]
    hbm, flops = peak_bandwidth(device), peak_flops(device)
    heads = HEADS["llama-3-8b"] if not args.cpu else HEADS["smollm2-135m"]
    num_q_heads, _, head_dim = heads
    sm_scale = head_dim ** -0.5
    dtype = jnp.bfloat16
    interpret = args.cpu
    num_sms = getattr(jax.devices()[0], "core_count", 132)  # a persistent grid's programs: one wave
    rng = np.random.default_rng(0)
    if args.cpu:
        decode_cases = {"decode 4 x 20-70": rng.integers(20, 70, 4).tolist()}
        page_sizes, blocks_kv, warps, stages = (16,), (32,), (4,), (2,)
        mixed = {"chunk 64 at 128": ([64], [128])}
        ragged_grid = [(16, 32, 4, 2)]
        paged_grid = [mgpu_config(1, 64, 2, in_registers=False),
                      mgpu_config(1, 64, 2, in_registers=False, overlap=True)]
        paged_decode_grid = list(paged_grid)
        paged_grid.insert(1, mgpu_config(1, 64, 2, in_registers=False, programs_per_kv_head=2))
        decode_page_sizes = (16, 32)
        chunk_cases = {"chunk 128 at 128": (128, 128)}
    else:
        decode_cases = {"decode 256 x 200-2048": rng.integers(200, 2049, 256).tolist(),
                        "decode 64 x 4096": [4096] * 64}
        page_sizes, blocks_kv, warps, stages = (16, 32, 64), (64, 128, 256), (4, 8), (2, 3, 4)
        mixed = {"chunk 1024 + 63 decodes": ([1024] + [1] * 63, [2048, *rng.integers(200, 2049, 63).tolist()]),
                 "prefill 2048": ([2048], [2048]), "chunk 1024 at 4096": ([1024], [4096]),
                 "chunk 512 at 8192": ([512], [8192])}
        ragged_grid = list(itertools.product((64, 128), (64, 128), (4, 8), (2, 3)))
        # FlashAttention-3's ways, measured and checked here first: the default (ping-pong) first, then on a
        # persistent grid (a program a multiprocessor, each walking its share of the query blocks: the fill and
        # drain once a program, not once a block; with and without ping-pong), then the default before stop 66
        # (no ping-pong), ping-pong in the requests' order and with the overlapped softmax
        per_head = one_wave(num_sms, heads[1])  # 16 on an H100/H200
        paged_grid = [mgpu_config(2, 128, 2, True, ping_pong=True),
                      mgpu_config(2, 128, 2, True, ping_pong=True, programs_per_kv_head=per_head),
                      mgpu_config(2, 128, 2, True, programs_per_kv_head=per_head), mgpu_config(2, 128, 2, True),
                      mgpu_config(2, 128, 2, True, ping_pong=True, heavy_first=False),
                      mgpu_config(2, 128, 2, True, ping_pong=True, overlap=True),
                      mgpu_config(2, 64, 4, True, ping_pong=True), mgpu_config(2, 128, 2, True, overlap=True),
                      mgpu_config(1, 128, 2, True, overlap=True), mgpu_config(2, 128, 2, False, ping_pong=True),
                      mgpu_config(1, 128, 2, True), mgpu_config(2, 64, 4, True), mgpu_config(2, 128, 2, False)]
        # Decodes: a program per request and KV head, its group's rows padded to a warpgroup's 64 (the tensor
        # cores idle; what counts is how close the page reads come to HBM's); the default first, then the
        # longest requests first (the default before stop 66), then a persistent grid (a program a
        # multiprocessor, each walking its requests' pages in one ring of stages: a short request's fill under
        # the one before; the longest first, dealt in a snake), then P in registers in the requests' order (not
        # measured yet), then the overlapped softmax (stop 66's H200 sweep: slower on both cases) and a
        # smaller block (stop 47's: (1, 64, 4) and (2, 128, 2) no better, dropped)
        paged_decode_grid = [mgpu_config(1, 128, 2, False, heavy_first=False),
                             mgpu_config(1, 128, 2, False, programs_per_kv_head=per_head),
                             mgpu_config(1, 128, 2, False),
                             mgpu_config(1, 128, 2, True, heavy_first=False),
                             mgpu_config(1, 128, 2, False, overlap=True, heavy_first=False),
                             mgpu_config(1, 64, 3, False, heavy_first=False)]
        decode_page_sizes = (16, 32, 64)  # 64 divides every block_kv of the grid
        chunk_cases = {"prefill 2048": (2048, 2048), "prefill 1024": (1024, 1024),
                       "chunk 1024 at 4096": (1024, 4096), "chunk 512 at 8192": (512, 8192),
                       "chunk 2048 at 8192": (2048, 8192)}
    results: list[Result] = []

    def report(r: Result) -> None:
        results.append(r)
        rate = "-" if r.rate is None else f"{r.rate:.2f}"
        frac = "-" if r.fraction is None else f"{r.fraction:.0%}"
        print(f"| {r.part} | {r.case} | {r.impl} | {r.config} | {r.us or 0:.1f} | {rate} | {frac} | "
              f"{r.max_abs_err if r.max_abs_err is not None else '-'} | {r.error or ''} |", flush=True)
        (args.out / f"{args.name}.json").write_text(json.dumps(
            {"device": device.device_kind, "peak_hbm": hbm, "peak_flops": flops,
             "results": [asdict(x) for x in results]}, indent=1))

    selected = [part for part in PARTS if part in args.parts]

    def over(part: str) -> bool:
        """Past the part's share of the budget: equal shares, in order, of the parts selected."""
        return time.monotonic() - start > (selected.index(part) + 1) / len(selected) * args.budget_s

    if args.focus:
        return focus(args, device, hbm, flops, heads, sm_scale, interpret, rng)
    print(f"device {device.device_kind}; HBM {hbm}; bf16 peak {flops}")
    print("| part | case | impl | config | us | TB/s or TFLOP/s | of peak | max abs err | error |")
    print("|---|---|---|---|---|---|---|---|---|")
    # 1. decode: page size x block_kv x warps x stages (page 16 first: what serves today)
    for name, kv_lens in decode_cases.items() if "decode" in args.parts else ():
        for page_size in page_sizes:
            inputs = build_inputs([1] * len(kv_lens), kv_lens, heads, page_size, dtype)
            reference = np.asarray(paged_fn("reference", True, sm_scale)(*inputs.args).astype(jnp.float32))
            amount = inputs.ideal_bytes()
            for block_kv, nw, ns in itertools.product(blocks_kv, warps, stages):
                if block_kv < page_size or over("decode"):
                    continue
                fn = jax.jit(lambda q, k, v, kv, pt, cu, b=block_kv, w=nw, s=ns: paged_decode_attention_pallas(
                    q, k, v, kv, pt, sm_scale=sm_scale, interpret=interpret, block_kv=b, num_warps=w, num_stages=s))
                report(measure("decode", name, "triton", f"page={page_size} block_kv={block_kv} warps={nw} "
                               f"stages={ns}", fn, inputs.args, reference, amount, hbm, args.iters, 1e12))
            del inputs
    # 2 and 3. prefill/mixed through the Triton ragged kernel per case, then jaxserve's Mosaic GPU kernel on
    # the same inputs, each configuration on every case before the next (the budget cuts configurations)
    prefill_part = "paged" if "paged" in args.parts else "paged-prefill"  # paged-prefill: these cases alone
    last_part = prefill_part if prefill_part in args.parts else "mixed"
    prefill_cases = []  # (name, inputs, reference, useful FLOPs)
    for name, (q_lens, kv_lens) in mixed.items() if {"mixed", prefill_part} & set(args.parts) else ():
        if over(last_part):
            break
        inputs = build_inputs(q_lens, kv_lens, heads, 16, dtype)
        reference = np.asarray(paged_fn("reference", False, sm_scale)(*inputs.args).astype(jnp.float32))
        amount = useful_flops(inputs, num_q_heads, head_dim)
        for block_rows, block_kv, nw, ns in ragged_grid if "mixed" in args.parts else ():
            if over("mixed"):
                break
            fn = jax.jit(lambda *a, r=block_rows, b=block_kv, w=nw, s=ns: ragged_paged_attention_pallas(
                *a, sm_scale=sm_scale, interpret=interpret, block_rows=r, block_kv=b, num_warps=w, num_stages=s))
            report(measure("mixed", name, "triton", f"rows={block_rows} block_kv={block_kv} warps={nw} stages={ns}",
                           fn, inputs.args, reference, amount, flops, args.iters, 1e12))
        if prefill_part in args.parts:
            prefill_cases.append((name, inputs, reference, amount))
    # First, each case as the engine's Hopper step runs it (`ragged_paged_attention_hopper`): requests of
    # MIN_Q_LEN tokens or more through the Mosaic GPU kernel's defaults, the rest (the mixed case's decodes)
    # through the Triton kernel beside it, the two outputs summed
    engine_fn = jax.jit(functools.partial(ragged_paged_attention_hopper, sm_scale=sm_scale, interpret=interpret))
    for name, inputs, reference, amount in prefill_cases:
        if over(prefill_part):
            break
        report(measure("paged", name, "engine-hopper", "mosaic-gpu defaults + triton for decodes", engine_fn,
                       inputs.args, reference, amount, flops, args.iters, 1e12))
        if over(prefill_part):
            break
        # With an FP8 cache (e4m3, the same seeds): the Triton kernel, then the Mosaic GPU kernel's FP8 settings
        # (`config_for`: its K/V widened in shared memory) with Triton for the decodes, as JAXSERVE_MOSAIC_FP8=1
        # runs the step; each against the reference over the cache's own values
        fp8 = build_inputs(inputs.q_lens, list(np.asarray(inputs.kv_lens)), heads, 16, dtype, cache_dtype=FP8)
        fp8_reference = np.asarray(paged_fn("reference", False, sm_scale)(*fp8.args).astype(jnp.float32))
        triton_fn = jax.jit(functools.partial(ragged_paged_attention_pallas, sm_scale=sm_scale, interpret=interpret))
        report(measure("paged", name, "triton-fp8", "defaults", triton_fn, fp8.args, fp8_reference, amount, flops,
                       args.iters, 1e12))
        report(measure("paged", name, "engine-hopper-fp8", "mosaic-gpu FP8 settings + triton for decodes", engine_fn,
                       fp8.args, fp8_reference, amount, flops, args.iters, 1e12))
        del fp8
    for kernel_config in paged_grid:
        config = " ".join(f"{key}={value}" for key, value in kernel_config.items())
        fn = jax.jit(functools.partial(ragged_paged_attention_mgpu, sm_scale=sm_scale, interpret=interpret,
                                       **kernel_config))
        for name, inputs, reference, amount in prefill_cases:
            if over(prefill_part):
                break
            report(measure("paged", name, "mosaic-gpu-paged", config, fn, inputs.args, reference, amount, flops,
                           args.iters, 1e12))
    del prefill_cases
    # 3, decodes: the Mosaic GPU kernel on part 1's cases beside the Triton decode kernel's defaults, on the
    # same inputs, in TB/s of K/V read; per page size (a page is one TMA copy: fewer, larger copies per stage)
    # and, at pages of 16, the ragged case on GPT-2's heads: 12 KV heads of 64, a GQA group of one, where a
    # GPT-2-shaped step on an H200 spent 1.69 of its 1.84 ms in the Triton decode kernel (stop 66)
    decode_part = "paged" if "paged" in args.parts else "paged-decode"  # paged-decode: these cases alone
    decode_cases_by_page = [(name, kv_lens, page, heads) for page in decode_page_sizes
                            for name, kv_lens in decode_cases.items()]
    if not args.cpu:
        decode_cases_by_page.insert(len(decode_cases), ("decode 256 x 200-2048, GPT-2 heads",
                                                        decode_cases["decode 256 x 200-2048"], 16, HEADS["gpt2"]))
    for name, kv_lens, page, case_heads in decode_cases_by_page if {"paged", "paged-decode"} & set(args.parts) else ():
        if over(decode_part):
            break
        case_scale = case_heads[2] ** -0.5
        inputs = build_inputs([1] * len(kv_lens), kv_lens, case_heads, page, dtype)
        reference = np.asarray(paged_fn("reference", True, case_scale)(*inputs.args).astype(jnp.float32))
        amount = inputs.ideal_bytes()
        for heavy_first in (True, False):  # the defaults (longest requests first), then the requests' order
            if over(decode_part):
                break
            fn = jax.jit(lambda q, k, v, kv, pt, cu, h=heavy_first, scale=case_scale: paged_decode_attention_pallas(
                q, k, v, kv, pt, sm_scale=scale, interpret=interpret, heavy_first=h))
            report(measure("paged", name, "triton", f"page={page} decode defaults heavy_first={heavy_first}", fn,
                           inputs.args, reference, amount, hbm, args.iters, 1e12))
        for kernel_config in paged_decode_grid:
            if over(decode_part):
                break
            if "programs_per_kv_head" in kernel_config and not args.cpu:  # one wave on this case's KV heads
                kernel_config = {**kernel_config, "programs_per_kv_head": one_wave(num_sms, case_heads[1])}
            fn = jax.jit(functools.partial(ragged_paged_attention_mgpu, sm_scale=case_scale, interpret=interpret,
                                           **kernel_config))
            config = " ".join(f"{key}={value}" for key, value in kernel_config.items())
            report(measure("paged", name, "mosaic-gpu-paged", f"page={page} {config}", fn, inputs.args, reference,
                           amount, hbm, args.iters, 1e12))
        del inputs
        if page != 16 or case_heads != heads or over(decode_part):
            continue
        # An FP8 cache (e4m3, half the bytes to read): the Triton decode kernel's defaults, then the Mosaic GPU
        # kernel at the settings `config_for` gives it (its stages widened in shared memory) and with a third
        # stage; TB/s of the FP8 bytes read
        inputs = build_inputs([1] * len(kv_lens), kv_lens, case_heads, page, dtype, cache_dtype=FP8)
        reference = np.asarray(paged_fn("reference", True, case_scale)(*inputs.args).astype(jnp.float32))
        amount = inputs.ideal_bytes()
        fn = jax.jit(lambda q, k, v, kv, pt, cu, scale=case_scale: paged_decode_attention_pallas(
            q, k, v, kv, pt, sm_scale=scale, interpret=interpret))
        report(measure("paged", name, "triton-fp8", f"page={page} decode defaults", fn, inputs.args, reference,
                       amount, hbm, args.iters, 1e12))
        fp8_config = config_for(True, dtype, FP8, *case_heads, page)
        # and 128 keys a step with P in registers, where that fits the shared memory (P's buffer goes)
        wide = {**(fp8_config or {}), "block_kv": 128, "p_in_registers": True}
        fp8_grid = [fp8_config, {**fp8_config, "stages": 3}] if fp8_config else []
        if fp8_config and supports(dtype, FP8, *case_heads, page, **wide) is None:
            fp8_grid.append(wide)
        for kernel_config in fp8_grid:
            if over(decode_part):
                break
            fn = jax.jit(functools.partial(ragged_paged_attention_mgpu, sm_scale=case_scale, interpret=interpret,
                                           heavy_first=False, **kernel_config))
            config = " ".join(f"{key}={value}" for key, value in kernel_config.items())
            report(measure("paged", name, "mosaic-gpu-paged-fp8", f"page={page} {config}", fn, inputs.args,
                           reference, amount, hbm, args.iters, 1e12))
        del inputs
    # 4. tensor-core candidates for one chunk
    for name, (q_len, kv_len) in chunk_cases.items() if "chunk" in args.parts else ():
        if over("chunk"):
            break
        inputs = build_inputs([q_len], [kv_len], heads, 16, dtype)
        reference = np.asarray(paged_fn("reference", False, sm_scale)(*inputs.args).astype(jnp.float32))
        amount = useful_flops(inputs, num_q_heads, head_dim)
        k, v = chunk_kv(inputs)
        # bfloat16 operands are refused by jax 0.11-0.12's kernel (float16 shared-memory buffers): one try
        for mgpu_dtype, block_kv, steps in ((jnp.float16, 128, 2), (jnp.float16, 64, 2), (jnp.float16, 128, 3),
                                            (jnp.bfloat16, 128, 2)):
            config = f"{jnp.dtype(mgpu_dtype).name} block_kv={block_kv} steps={steps}"
            try:
                fn, fargs = mgpu_chunk_fn(inputs, k, v, sm_scale, 64, block_kv, mgpu_dtype, steps)
            except Exception as e:
                report(Result("chunk", name, "mosaic-gpu", config, None, None, None, None,
                              f"{type(e).__name__}: {str(e)[:200]}"))
                continue
            report(measure("chunk", name, "mosaic-gpu", config, fn, fargs, reference, amount, flops, args.iters,
                           1e12))
        if q_len == kv_len:
            report(measure("chunk", name, "cudnn", "is_causal", cudnn_fn(sm_scale), (inputs.q, k, v), reference,
                           amount, flops, args.iters, 1e12))
    print(f"attention sweep done in {time.monotonic() - start:.0f}s")


def focus(args, device, hbm, flops, heads, sm_scale, interpret, rng) -> None:
    """Decode kernel configurations side by side, interleaved over rounds (medians), bfloat16 and FP8."""
    num_q_heads, _, head_dim = heads
    if args.cpu:
        decode_cases = {"decode 4 x 20-70": rng.integers(20, 70, 4).tolist()}
        configs = [(32, 4, 2), (16, 4, 3)]
        mixed = {"chunk 64 at 128": ([64], [128])}
    else:
        decode_cases = {"decode 256 x 200-2048": rng.integers(200, 2049, 256).tolist(), "decode 64 x 4096": [4096] * 64}
        configs = [(128, 4, 2), (128, 4, 3), (64, 4, 3)]  # the default and the H100 sweep's two best
        mixed = {"chunk 1024 + 63 decodes": ([1024] + [1] * 63, [2048, *rng.integers(200, 2049, 63).tolist()])}
    rows = []
    print(f"device {device.device_kind}; HBM {hbm}; bf16 peak {flops}")
    print("| case | cache | block_kv, warps, stages | us (median of rounds) | TB/s of K/V | of HBM peak | "
          "max abs err vs reference |")
    print("|---|---|---|---|---|---|---|")
    for name, kv_lens in decode_cases.items():
        for cache_dtype in (jnp.bfloat16, jnp.float8_e4m3fn):
            inputs = build_inputs([1] * len(kv_lens), kv_lens, heads, 16, jnp.bfloat16, cache_dtype=cache_dtype)
            reference = np.asarray(paged_fn("reference", True, sm_scale)(*inputs.args).astype(jnp.float32))
            fns = {c: jax.jit(lambda q, k, v, kv, pt, cu, c=c: paged_decode_attention_pallas(
                q, k, v, kv, pt, sm_scale=sm_scale, interpret=interpret, block_kv=c[0], num_warps=c[1],
                num_stages=c[2])) for c in configs}
            samples: dict[tuple, list[Result]] = {c: [] for c in configs}
            for _ in range(args.rounds):
                for c, fn in fns.items():
                    samples[c].append(measure("decode", name, "triton", str(c), fn, inputs.args, reference,
                                              inputs.ideal_bytes(), hbm, args.iters, 1e12))
            for c, results in samples.items():
                ok = [r for r in results if r.us is not None]
                if not ok:
                    rows.append(asdict(results[0]))
                    print(f"| {name} | {jnp.dtype(cache_dtype).name} | {c} | - | - | - | {results[0].error} |")
                    continue
                best = sorted(ok, key=lambda r: r.us)[len(ok) // 2]
                rows.append({**asdict(best), "cache": jnp.dtype(cache_dtype).name, "all_us": [r.us for r in ok]})
                frac = "-" if best.fraction is None else f"{best.fraction:.0%}"
                print(f"| {name} | {jnp.dtype(cache_dtype).name} | {c} | {best.us:.1f} | {best.rate:.2f} | {frac} | "
                      f"{best.max_abs_err:.3g} |", flush=True)
            del inputs
    for name, (q_lens, kv_lens) in mixed.items():
        for cache_dtype in (jnp.bfloat16, jnp.float8_e4m3fn):
            inputs = build_inputs(q_lens, kv_lens, heads, 16, jnp.bfloat16, cache_dtype=cache_dtype)
            reference = np.asarray(paged_fn("reference", False, sm_scale)(*inputs.args).astype(jnp.float32))
            fn = jax.jit(lambda *a: ragged_paged_attention_pallas(*a, sm_scale=sm_scale, interpret=interpret))
            r = measure("mixed", name, "triton", "default", fn, inputs.args, reference,
                        useful_flops(inputs, num_q_heads, head_dim), flops, args.iters, 1e12)
            rows.append({**asdict(r), "cache": jnp.dtype(cache_dtype).name})
            print(f"| {name} | {jnp.dtype(cache_dtype).name} | default | {r.us or 0:.1f} | {r.rate or 0:.1f} TFLOP/s "
                  f"| {r.fraction or 0:.0%} | {r.max_abs_err} {r.error or ''} |", flush=True)
    (args.out / "attention_focus.json").write_text(json.dumps({"device": device.device_kind, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
