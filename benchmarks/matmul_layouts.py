"""XLA:CPU matmuls in SmolLM2's shapes: which weight layout runs fastest, per row count.

A decode step's matmuls take an activation x[T, D] and a weight. The weight can be stored as [D, F]
(contracting its major axis: `TD,DF->TF`, what the models do) or transposed as [F, D] (contracting its
minor axis, the layout PyTorch's nn.Linear and GGUF use: `TD,FD->TF`). This times 30 layers of SmolLM2's
MLP (gate and up 576 -> 1536, down 1536 -> 576; 318 MB of float32 weights, more than any cache) and its
LM head (576 -> 49,152) in both layouts, alternating in one process, at 1, 16 and 64 rows. XLA flags go
in `--xla-flags` (set before jax starts).

    python benchmarks/matmul_layouts.py --rows 1 16 64 [--dtype bfloat16] [--xla-flags "--xla_cpu_..."]
"""

import argparse
import os
import statistics
import time

D, F, V, LAYERS = 576, 1536, 49152, 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds; the median is reported")
    parser.add_argument("--calls", type=int, default=5, help="calls per timed sample")
    parser.add_argument("--xla-flags", default="")
    args = parser.parse_args()
    if args.xla_flags:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + args.xla_flags).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax
    import jax.numpy as jnp
    import numpy as np

    dtype = jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)

    def weights(*shape: int) -> jax.Array:
        return jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02, dtype)

    # Per layer: gate, up, down; "DF" stores what a dot contracts on the major axis, "FD" on the minor.
    mlp_df = [(weights(D, F), weights(D, F), weights(F, D)) for _ in range(LAYERS)]
    mlp_fd = [(g.T.copy(), u.T.copy(), d.T.copy()) for g, u, d in mlp_df]  # [F, D], [F, D], [D, F]
    head_dv = weights(D, V)
    head_vd = head_dv.T.copy()  # [V, D]: GGUF's and the tied embedding's layout

    def mlp_stack_df(x, layers):
        for gate, up, down in layers:
            h = jax.nn.silu(jnp.einsum("TD,DF->TF", x, gate)) * jnp.einsum("TD,DF->TF", x, up)
            x = x + jnp.einsum("TF,FD->TD", h, down)
        return x

    def mlp_stack_fd(x, layers):
        for gate, up, down in layers:
            h = jax.nn.silu(jnp.einsum("TD,FD->TF", x, gate)) * jnp.einsum("TD,FD->TF", x, up)
            x = x + jnp.einsum("TF,DF->TD", h, down)
        return x

    variants = {
        "MLPs, weights [D, F] (now)": (jax.jit(mlp_stack_df), mlp_df),
        "MLPs, weights [F, D]": (jax.jit(mlp_stack_fd), mlp_fd),
        "LM head [D, V] (untied now)": (jax.jit(lambda x, w: jnp.einsum("TD,DV->TV", x, w)), head_dv),
        "LM head [V, D] (tied now)": (jax.jit(lambda x, w: jnp.einsum("TD,VD->TV", x, w)), head_vd),
    }
    print(f"dtype {args.dtype}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    print("| piece | " + " | ".join(f"{r} rows ms" for r in args.rows) + " |")
    print("|---|" + "---|" * len(args.rows))
    results: dict[str, dict[int, list[float]]] = {name: {r: [] for r in args.rows} for name in variants}
    inputs = {r: jnp.asarray(rng.standard_normal((r, D), np.float32), dtype) for r in args.rows}
    for fn, w in variants.values():  # compile and first runs outside the timing
        for r in args.rows:
            jax.block_until_ready(fn(inputs[r], w))
    for _ in range(args.rounds):
        for name, (fn, w) in variants.items():
            for r in args.rows:
                start = time.perf_counter()
                for _ in range(args.calls):
                    out = fn(inputs[r], w)
                jax.block_until_ready(out)
                results[name][r].append((time.perf_counter() - start) / args.calls * 1e3)
    for name, by_rows in results.items():
        print(f"| {name} | " + " | ".join(f"{statistics.median(by_rows[r]):.2f}" for r in args.rows) + " |")


if __name__ == "__main__":
    main()
