"""The Mosaic GPU paged kernel's launch order, modelled: how long a step's programs take on a GPU's
multiprocessors when they start in the order of the requests, and when the heaviest start first.

A model, not a measurement: it runs here, on a CPU, from the kernel's own block descriptions
(`paged_attention_mgpu._describe_blocks`) for the cases `attention_sweep.py` times on a GPU (Llama-3-8B
heads, pages of 16). Each program costs `overhead` plus its steps over the keys, in units of one step (a
block of keys through Q K^T, the softmax and P V); a multiprocessor runs one program at a time (the
kernel's shared memory fills it: `shared_memory_bytes`), and a free one takes the next program in launch
order, the last grid axis fastest, as a GPU's block scheduler does. It reports each order's makespan over
the work's lower bound (every multiprocessor busy to the end), and the ratio of the two makespans: the
step-time gain the order alone predicts where the programs' costs are as modelled. A second table does
the same for the Triton split-KV decode kernel's programs on the decode cases.

    python benchmarks/launch_order.py                 # an H100's or H200's 132 multiprocessors
    python benchmarks/launch_order.py --sms 108       # an A100's
"""

import argparse
import heapq

import jax.numpy as jnp
import numpy as np

from jaxserve.ops import paged_attention_mgpu as mgpu
from jaxserve.ops.paged_attention_pallas import ScoreRule
from jaxserve.platform import prepare_jax_platform

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3-8B


def cases(rng: np.random.Generator) -> dict[str, tuple[list[int], list[int], dict]]:
    """The sweep's cases: (query lengths, key lengths, the kernel's configuration for them)."""
    prefill, decode = mgpu.DEFAULTS, mgpu.DECODE_DEFAULTS
    return {
        "prefill 2048": ([2048], [2048], prefill),
        "chunk 1024 + 63 decodes": ([1024] + [1] * 63, [2048, *rng.integers(200, 2049, 63).tolist()], prefill),
        "chunk 1024 at 4096": ([1024], [4096], prefill),
        "chunk 512 at 8192": ([512], [8192], prefill),
        "decode 256 x 200-2048": ([1] * 256, rng.integers(200, 2049, 256).tolist(), decode),
        "decode 64 x 4096": ([1] * 64, [4096] * 64, decode),
    }


# The orders compared: (name, blocks sorted heaviest first, KV head the fastest axis of the launch order)
ORDERS = [("before: requests' order, KV head slowest", False, False),
          ("requests' order, KV head fastest (heavy_first=False: the decode default)", False, True),
          ("heaviest first (the prefill default)", True, True)]


def launch_costs(q_lens: list[int], kv_lens: list[int], config: dict, heavy_first: bool, head_fastest: bool,
                 overhead: float) -> list[float]:
    """Each program's cost in steps, in launch order: the grid (block, KV head) launches every KV head of a
    block before the next block; the grid before this order, (KV head, block), every block of a KV head."""
    block_q = mgpu.block_q_for(NUM_Q_HEADS, NUM_KV_HEADS, config["num_consumers"])
    padded = max(-(-sum(q_lens) // 8) * 8, block_q)
    info = np.asarray(mgpu._describe_blocks(
        jnp.asarray(np.cumsum([0, *q_lens]), jnp.int32), jnp.asarray(kv_lens, jnp.int32), padded, block_q,
        config["block_kv"], ScoreRule(HEAD_DIM**-0.5, None, None), None, heavy_first))
    steps = info[:, mgpu._END_STEP] - info[:, mgpu._FIRST_STEP]  # i32[NB]
    costs = np.where(info[:, mgpu._NUM_VALID] > 0, steps + overhead, 0.0)
    return (np.repeat(costs, NUM_KV_HEADS) if head_fastest else np.tile(costs, NUM_KV_HEADS)).tolist()


def triton_decode_costs(kv_lens: list[int], heavy_first: bool, overhead: float, block_kv: int = 64) -> list[float]:
    """The Triton split-KV decode's programs, one split each (requests x KV heads fill the GPU): a program
    per request and KV head walking its keys `block_kv` at a time, in launch order. The grid is (split, KV
    head, request), the longest requests first; before, (request, KV head, split), every request of a KV
    head in turn."""
    costs = np.ceil(np.asarray(kv_lens) / block_kv) + overhead  # f[R]
    if heavy_first:
        return np.repeat(np.sort(costs)[::-1], NUM_KV_HEADS).tolist()
    return np.tile(costs, NUM_KV_HEADS).tolist()


def makespan(costs: list[float], sms: int) -> float:
    """List scheduling: each program, in order, on the multiprocessor that frees first."""
    free_at = [0.0] * sms
    for cost in costs:
        heapq.heappush(free_at, heapq.heappop(free_at) + cost)
    return max(free_at)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sms", type=int, default=132)
    parser.add_argument("--overheads", type=float, nargs="+", default=[0.5, 2.0],
                        help="a program's fixed cost (its queries, the pipeline's fill, its stores) in steps")
    args = parser.parse_args()
    prepare_jax_platform()  # the CPU, quietly: nothing here runs on a GPU
    print(f"{args.sms} multiprocessors, one program each; makespans over the lower bound (total work / SMs)")
    print("| case | programs | overhead (steps) | " + " | ".join(name for name, _, _ in ORDERS) +
          " | predicted speed-up, heaviest first over before |")
    print("|---|---|---|" + "---|" * (len(ORDERS) + 1))
    for name, (q_lens, kv_lens, config) in cases(np.random.default_rng(0)).items():
        for overhead in args.overheads:
            spans = []
            for _, heavy_first, head_fastest in ORDERS:
                costs = launch_costs(q_lens, kv_lens, config, heavy_first, head_fastest, overhead)
                spans.append(makespan(costs, args.sms) / (sum(costs) / args.sms))
            programs = sum(c > 0 for c in costs)
            print(f"| {name} | {programs} | {overhead} | " + " | ".join(f"{x:.3f}" for x in spans) +
                  f" | {spans[0] / spans[-1]:.2f}x |")
    print("\nThe Triton split-KV decode (steps of 64 keys): before | longest first | predicted speed-up")
    for name, (q_lens, kv_lens, _) in cases(np.random.default_rng(0)).items():
        if set(q_lens) != {1}:
            continue
        for overhead in args.overheads:
            spans = []
            for heavy_first in (False, True):
                costs = triton_decode_costs(kv_lens, heavy_first, overhead)
                spans.append(makespan(costs, args.sms) / (sum(costs) / args.sms))
            print(f"| {name} | {overhead} | {spans[0]:.3f} | {spans[1]:.3f} | {spans[0] / spans[1]:.2f}x |")


if __name__ == "__main__":
    main()
