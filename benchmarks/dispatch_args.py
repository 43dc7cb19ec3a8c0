"""What a jitted call's argument count costs the host: the lever "fewer dispatch arguments" measured
before it is built (stacking the weights into a few buffers is a model-wide change).

Calls a compiled executable whose inputs are N device arrays (N = GPT-2's ~180 and Llama-3-8B's ~363
weight leaves, and a handful) and whose work is a trivial add on one of them, and reports the median
dispatch time (the call until it returns, device work queued) and the per-argument slope. The device's
own work is the same for every N, so the difference is the host's cost of passing arguments.

    python benchmarks/dispatch_args.py [--counts 4 32 180 363] [--calls 2000]
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp


def dispatch_ms(num_args: int, calls: int) -> float:
    """Median ms per call of a compiled function taking `num_args` arrays."""
    args = [jnp.full((256,), i, jnp.float32) for i in range(num_args)]

    @jax.jit
    def step(weights: list[jax.Array], x: jax.Array) -> jax.Array:
        return x + weights[0][:1]

    x = jnp.zeros((1,), jnp.float32)
    compiled = step.lower(args, x).compile()
    for _ in range(50):
        x = compiled(args, x)
    x.block_until_ready()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        x = compiled(args, x)
        times.append(time.perf_counter() - start)
    x.block_until_ready()
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", type=int, nargs="+", default=[4, 32, 180, 363])
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    print(f"{jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}")
    results = [(n, dispatch_ms(n, args.calls)) for n in args.counts]
    for n, ms in results:
        print(f"{n:5d} arguments: {ms * 1e3:8.1f} us per dispatch")
    (n0, t0), (n1, t1) = results[0], results[-1]
    print(f"slope: {(t1 - t0) * 1e6 / (n1 - n0):.2f} ns per argument")


if __name__ == "__main__":
    main()
