"""Attention microbenchmark: the Pallas kernels vs the jnp reference vs XLA's dense attention.

Two sweeps, on the same shuffled paged cache:
- decode: batch x context, one query token per request (the decode kernel; `pallas-ragged` runs the general
  kernel on the same batch to show what the decode specialisation buys);
- mixed: prefill chunks and decodes in one ragged batch (the general kernel).

For each case and implementation it reports the median time per call, the achieved bandwidth over the
ideal traffic (every request's K/V read once, q read and the output written once), that bandwidth as a
fraction of the device's peak HBM bandwidth, and the largest difference from the reference output.
`dense` is `jax.nn.dot_product_attention` over contiguous per-request K/V padded to the longest context
(what serving without pages would run); its inputs are built outside the timed region.

    # On a GPU (Llama-3-8B heads, bfloat16): the full sweep
    python benchmarks/attention.py --json docs/attention.json
    # CPU smoke run
    python benchmarks/attention.py --impls reference dense --batch-sizes 1 4 --context-lens 128 --mixed none
    # DeepSeek's latent cache: one KV head of 576 dims, keys alone (read as the values too)
    python benchmarks/attention.py --heads deepseek-v2-lite --values-are-keys
"""

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.ops.attention import MIN_PALLAS_COMPUTE_CAPABILITY, cuda_compute_capability, ragged_paged_attention
from jaxserve.ops.paged_attention_pallas import paged_decode_attention_pallas, ragged_paged_attention_pallas
from jaxserve.platform import prepare_jax_platform

# Peak HBM bandwidth in bytes/s by device_kind substring, most specific first (vendor datasheets).
PEAK_HBM_BYTES_PER_S = [
    ("H200", 4.8e12),
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),  # SXM5 (HBM3)
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12),  # 40 GB
    ("L40S", 0.864e12),
    ("L4", 0.3e12),
]
HEADS = {"gpt2": (12, 12, 64), "smollm2-135m": (9, 3, 64), "llama-3-8b": (32, 8, 128),
         "deepseek-v2-lite": (16, 1, 576)}  # its latent attention: all heads on one KV head of C + R
# With --values-are-keys, the values' dims (the keys' first ones) of the heads that read them so: DeepSeek's
# latent C, as the model asks (its RoPE key's R dims are the rest)
LATENT_VALUE_DIMS = {"deepseek-v2-lite": 512}
MIXES = {  # name -> (q_len per request, kv_len per request)
    "prefill 1x2048": ([2048], [2048]),
    "chunks 4x512 after 1536": ([512] * 4, [2048] * 4),
    "2x512 chunks + 62 decodes@2048": ([512, 512] + [1] * 62, [1024, 1024] + [2048] * 62),
    # the CPU preset's chunks: a long prompt's last 128-token chunk; one chunk among 15 decodes
    "chunk 128 at 8192": ([128], [8192]),
    "chunk 512 at 8192": ([512], [8192]),  # the bundled ladders' chunk: what an 8k prompt's TTFT runs
    "chunk 113 + 15 decodes@512": ([113] + [1] * 15, [1024] + [512] * 15),
}


def peak_bandwidth(device: jax.Device) -> float | None:
    for name, peak in PEAK_HBM_BYTES_PER_S:
        if name.lower() in device.device_kind.lower():
            return peak
    return None


@dataclass
class PagedInputs:
    q: jax.Array  # [T, N, H]
    k_pages: jax.Array  # [K, num_pages, page_size, H]
    v_pages: jax.Array | None  # None: the values are the keys (a cache of one array)
    kv_lens: jax.Array  # i32[R]
    page_table: jax.Array  # i32[R, P]
    cu_q_lens: jax.Array  # i32[R+1]
    q_lens: list[int]
    value_dims: int | None = None  # with v_pages None: the output is the keys' first value_dims dims

    @property
    def args(self) -> tuple[jax.Array, ...]:
        return self.q, self.k_pages, self.v_pages, self.kv_lens, self.page_table, self.cu_q_lens

    def ideal_bytes(self) -> int:
        num_kv_heads, _, _, head_dim = self.k_pages.shape
        arrays = 1 if self.v_pages is None else 2
        kv = arrays * int(np.sum(np.asarray(self.kv_lens))) * num_kv_heads * head_dim * self.k_pages.dtype.itemsize
        return kv + 2 * self.q.size * self.q.dtype.itemsize


def build_inputs(q_lens: list[int], kv_lens: list[int], heads: tuple[int, int, int], page_size: int,
                 dtype: jnp.dtype, seed: int = 0, cache_dtype: jnp.dtype | None = None,
                 values_are_keys: bool = False, value_dims: int | None = None) -> PagedInputs:
    num_q_heads, num_kv_heads, head_dim = heads
    rng = np.random.default_rng(seed)
    pages_per_req = [-(-kv // page_size) for kv in kv_lens]
    num_pages = 1 + sum(pages_per_req)
    page_ids = rng.permutation(np.arange(1, num_pages)).astype(np.int32)  # shuffled, page 0 is scratch
    page_table = np.zeros((len(kv_lens), max(pages_per_req)), np.int32)
    start = 0
    for r, n in enumerate(pages_per_req):
        page_table[r, :n] = page_ids[start : start + n]
        start += n
    keys = jax.random.split(jax.random.key(seed), 3)
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    k_pages = jax.random.normal(keys[0], shape, cache_dtype or dtype)
    v_pages = None if values_are_keys else jax.random.normal(keys[1], shape, cache_dtype or dtype)
    q = jax.random.normal(keys[2], (sum(q_lens), num_q_heads, head_dim), dtype)
    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return PagedInputs(q, k_pages, v_pages, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(page_table),
                       jnp.asarray(cu_q_lens), list(q_lens), value_dims if values_are_keys else None)


def dense_attention_fn(inputs: PagedInputs, sm_scale: float) -> tuple[Callable, tuple, Callable]:
    """XLA's dense attention on padded contiguous K/V: (fn, args, unpack to packed tokens)."""
    num_kv_heads, _, page_size, head_dim = inputs.k_pages.shape
    num_reqs, max_pages = inputs.page_table.shape

    def contiguous(pages: jax.Array) -> jax.Array:  # [R, L, K, H]
        gathered = pages[:, inputs.page_table]  # [K, R, P, page_size, H]
        return gathered.reshape(num_kv_heads, num_reqs, max_pages * page_size, head_dim).transpose(1, 2, 0, 3)

    k = jax.jit(contiguous)(inputs.k_pages)
    v = k if inputs.v_pages is None else jax.jit(contiguous)(inputs.v_pages)
    q_lens = np.asarray(inputs.q_lens)
    max_q = int(q_lens.max())
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    token_req = np.repeat(np.arange(num_reqs), q_lens)
    token_row = np.arange(int(cu[-1])) - cu[token_req]
    q = jnp.zeros((num_reqs, max_q, *inputs.q.shape[1:]), inputs.q.dtype).at[token_req, token_row].set(inputs.q)
    kv_lens = np.asarray(inputs.kv_lens)
    query_pos = kv_lens[:, None] - q_lens[:, None] + np.arange(max_q)[None, :]  # [R, Q]
    mask = np.arange(k.shape[1])[None, None, :] <= query_pos[:, :, None]  # [R, Q, L]
    mask = jnp.asarray(mask[:, None])  # [R, 1, Q, L]

    def fn(q, k, v, mask):
        return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=sm_scale)

    return jax.jit(fn), (q, k, v, mask), lambda out: out[token_req, token_row][..., :inputs.value_dims]


def paged_fn(impl: str, decode: bool, sm_scale: float, value_dims: int | None = None) -> Callable:
    if impl in ("reference", "cpu", "cpu-native"):
        return jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=sm_scale, impl=impl, decode_only=decode,
                                                         value_dims=value_dims))
    interpret = impl == "interpret"
    if decode and impl in ("pallas", "interpret"):
        return jax.jit(lambda q, k, v, kv, pt, cu: paged_decode_attention_pallas(
            q, k, v, kv, pt, sm_scale=sm_scale, interpret=interpret, value_dims=value_dims))
    return jax.jit(lambda *a: ragged_paged_attention_pallas(*a, sm_scale=sm_scale, interpret=interpret,
                                                            value_dims=value_dims))


def time_per_call(fn: Callable, args: tuple, iters: int, calls_per_sample: int) -> float:
    """Median seconds per call; each sample queues several calls before waiting, hiding dispatch."""
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        for _ in range(calls_per_sample):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / calls_per_sample)
    return statistics.median(samples)


@dataclass
class Row:
    sweep: str
    case: str
    batch: int
    context: int
    impl: str
    us_per_call: float
    gb_per_s: float
    peak_fraction: float | None
    max_abs_err: float


def run_case(sweep: str, case: str, inputs: PagedInputs, impls: list[str], sm_scale: float, iters: int,
             calls_per_sample: int, peak: float | None) -> list[Row]:
    decode = sweep == "decode"
    reference = np.asarray(paged_fn("reference", decode, sm_scale, inputs.value_dims)(*inputs.args)
                           .astype(jnp.float32))
    rows = []
    for impl in impls:
        if impl == "pallas-ragged" and not decode:
            continue
        if impl == "dense":
            fn, args, unpack = dense_attention_fn(inputs, sm_scale)
        else:
            fn, args, unpack = paged_fn(impl.removesuffix("-ragged"), decode and impl != "pallas-ragged",
                                        sm_scale, inputs.value_dims), inputs.args, lambda out: out
        seconds = time_per_call(fn, args, iters, calls_per_sample)
        err = float(np.abs(np.asarray(unpack(fn(*args)).astype(jnp.float32)) - reference).max())
        bandwidth = inputs.ideal_bytes() / seconds
        rows.append(Row(sweep, case, len(inputs.q_lens), int(np.asarray(inputs.kv_lens).max()), impl,
                        seconds * 1e6, bandwidth / 1e9, bandwidth / peak if peak else None, err))
        print(format_row(rows[-1]), flush=True)
    return rows


def format_row(row: Row) -> str:
    fraction = f"{100 * row.peak_fraction:.1f}%" if row.peak_fraction is not None else "n/a"
    return (f"| {row.case} | {row.impl} | {row.us_per_call:.1f} | {row.gb_per_s:.1f} | {fraction} "
            f"| {row.max_abs_err:.1e} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impls", nargs="+", default=["pallas", "pallas-ragged", "reference", "dense"],
                        choices=["pallas", "pallas-ragged", "reference", "cpu", "cpu-native", "dense", "interpret"])
    parser.add_argument("--heads", default="llama-3-8b", choices=sorted(HEADS))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--cache-dtype", default=None, choices=["bfloat16", "float32", "float16"],
                        help="the K/V pages' dtype (default: --dtype); cpu-native and the jnp paths read any")
    parser.add_argument("--values-are-keys", action="store_true",
                        help="a cache of keys alone, read as the values too (DeepSeek's latent cache: the "
                             "output is its first 512 dims, as the model asks)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--context-lens", type=int, nargs="+", default=[128, 512, 2048, 4096])
    parser.add_argument("--mixed", nargs="+", default=sorted(MIXES), help=f"'none' or any of {sorted(MIXES)}")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--calls-per-sample", type=int, default=5)
    parser.add_argument("--peak-gbps", type=float, default=None, help="override the device's peak HBM GB/s")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args()

    prepare_jax_platform()  # as the CLI does: no CUDA plugin tracebacks on a machine without a GPU
    device = jax.devices()[0]
    capability = cuda_compute_capability(device)
    impls = list(args.impls)
    if (capability or 0.0) < MIN_PALLAS_COMPUTE_CAPABILITY and any(i.startswith("pallas") for i in impls):
        print(f"no CUDA GPU of compute capability >= {MIN_PALLAS_COMPUTE_CAPABILITY} here: skipping the compiled "
              "kernel (use --impls interpret to run it slowly)")
        impls = [i for i in impls if not i.startswith("pallas")]
    peak = args.peak_gbps * 1e9 if args.peak_gbps else peak_bandwidth(device)
    dtype = jnp.dtype(args.dtype)
    cache_dtype = jnp.dtype(args.cache_dtype or args.dtype)
    heads = HEADS[args.heads]
    sm_scale = heads[2] ** -0.5
    print(f"device: {device.device_kind} (compute capability {capability}); peak HBM "
          f"{peak / 1e9 if peak else 'unknown'} GB/s; heads {args.heads} {heads}; {args.dtype}, cache {cache_dtype}; "
          f"page size {args.page_size}{'; values are the keys' if args.values_are_keys else ''}")
    print("| case | impl | us/call | GB/s | of peak | max abs err vs reference |")
    print("|---|---|---|---|---|---|")
    rows: list[Row] = []
    for batch in args.batch_sizes:
        for context in args.context_lens:
            inputs = build_inputs([1] * batch, [context] * batch, heads, args.page_size, dtype,
                                  cache_dtype=cache_dtype, values_are_keys=args.values_are_keys,
                                  value_dims=LATENT_VALUE_DIMS.get(args.heads))
            rows += run_case("decode", f"decode b={batch} ctx={context}", inputs, impls, sm_scale, args.iters,
                             args.calls_per_sample, peak)
            del inputs
    for name in [m for m in args.mixed if m != "none"]:
        q_lens, kv_lens = MIXES[name]
        inputs = build_inputs(q_lens, kv_lens, heads, args.page_size, dtype, cache_dtype=cache_dtype,
                              values_are_keys=args.values_are_keys, value_dims=LATENT_VALUE_DIMS.get(args.heads))
        rows += run_case("mixed", name, inputs, impls, sm_scale, args.iters, args.calls_per_sample, peak)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device.device_kind, "dtype": args.dtype, "cache_dtype": cache_dtype.name,
                       "heads": args.heads,
                       "page_size": args.page_size, "rows": [asdict(r) for r in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
