"""Scan over layers against the unrolled layer loop: compile time and step time, side by side.

The question behind it: compiling 30 unrolled decoder layers is most of jaxserve's warm-up, and MaxText's
remedy is one layer body under `jax.lax.scan` over stacked weights. This measures a SmolLM2-sized stack
of the step's matmuls (no attention) both ways on this CPU (compile seconds, then milliseconds per call,
alternating), and compiles a Llama-3-8B-sized stack both ways for an H100 without a GPU to see what
XLA:GPU does with the per-layer weight slice (the dynamic-slice copies and the temp memory they take).

    python benchmarks/scan_layers.py --tokens 1 32
    python benchmarks/scan_layers.py --h100
"""

import argparse
import re
import time

import numpy as np

SMOLLM2 = dict(layers=30, hidden=576, mlp=1536, qkv=960)  # q 9 x 64 + k, v 3 x 64 each
LLAMA_3_8B = dict(layers=32, hidden=4096, mlp=14336, qkv=6144)


def _layer(x, p):  # [T, D] -> [T, D]: the q/k/v, output and MLP matmuls of one decoder layer
    import jax

    h = x @ p["qkv"]
    x = x + h[:, : x.shape[1]] @ p["o"]
    return x + (jax.nn.silu(x @ p["gate"]) * (x @ p["up"])) @ p["down"]


def _shapes(dims: dict) -> dict:
    d, f = dims["hidden"], dims["mlp"]
    return dict(qkv=(d, dims["qkv"]), o=(d, d), gate=(d, f), up=(d, f), down=(f, d))


def _functions():
    import jax

    @jax.jit
    def unrolled(x, layers):  # layers: a list of per-layer dicts
        for p in layers:
            x = _layer(x, p)
        return x

    @jax.jit
    def scanned(x, stacked):  # stacked: one dict of [L, ...] arrays
        return jax.lax.scan(lambda c, p: (_layer(c, p), None), x, stacked)[0]

    return unrolled, scanned


def cpu(tokens: list[int], rounds: int) -> None:
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    dims = SMOLLM2
    layers = [{k: jnp.asarray(rng.standard_normal(s, np.float32) * 0.02) for k, s in _shapes(dims).items()}
              for _ in range(dims["layers"])]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    unrolled, scanned = _functions()
    jax.jit(lambda a: a + 1).lower(jnp.ones(4)).compile()  # the backend's one-time start, outside the timings
    print("| T | compile s unrolled | compile s scan | ms/call unrolled | ms/call scan | scan / unrolled |")
    print("|---|---|---|---|---|---|")
    for t in tokens:
        x = jnp.ones((t, dims["hidden"]), jnp.float32)
        runs = {"unrolled": (unrolled, layers), "scan": (scanned, stacked)}
        compile_s = {}
        for name, (fn, weights) in runs.items():
            start = time.perf_counter()
            fn.lower(x, weights).compile()
            compile_s[name] = time.perf_counter() - start
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(rounds):  # alternating, so both see the same machine
            for name, (fn, weights) in runs.items():
                fn(x, weights).block_until_ready()
                start = time.perf_counter()
                for _ in range(10):
                    y = fn(x, weights)
                y.block_until_ready()
                times[name].append((time.perf_counter() - start) / 10 * 1e3)
        best = {name: min(v) for name, v in times.items()}
        print(f"| {t} | {compile_s['unrolled']:.2f} | {compile_s['scan']:.2f} | {best['unrolled']:.1f} | "
              f"{best['scan']:.1f} | {best['scan'] / best['unrolled']:.2f} |", flush=True)


def h100(tokens: int) -> None:
    from jaxserve.device import deviceless_device, use_cpu_platform
    from jaxserve.parallel import on_one_device

    use_cpu_platform()
    import jax
    import jax.numpy as jnp

    sharding = on_one_device(deviceless_device("h100"))
    dims = LLAMA_3_8B

    def spec(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=sharding)

    shapes = _shapes(dims)
    layers = [{k: spec(*s) for k, s in shapes.items()} for _ in range(dims["layers"])]
    stacked = {k: spec(dims["layers"], *s) for k, s in shapes.items()}
    unrolled, scanned = _functions()
    x = spec(tokens, dims["hidden"])
    print(f"| Llama-3-8B-sized, H100, T={tokens} | compile s | temp MiB | weight-slice copies in the loop |")
    print("|---|---|---|---|")
    for name, fn, weights in (("unrolled", unrolled, layers), ("scan", scanned, stacked)):
        start = time.perf_counter()
        compiled = fn.trace(x, weights).lower().compile()
        seconds = time.perf_counter() - start
        text = compiled.as_text()
        copies = len(re.findall(r"ROOT %\S+ = \S+ copy\(%dynamic_slice", text))
        temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
        print(f"| {name} | {seconds:.1f} | {temp:.0f} | {copies} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--h100", action="store_true", help="compile a Llama-3-8B-sized stack for an H100 instead")
    args = parser.parse_args()
    if args.h100:
        h100(64)
    else:
        cpu(args.tokens, args.rounds)


if __name__ == "__main__":
    main()
