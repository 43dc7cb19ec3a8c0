"""The LoRA stacks alone, in one jitted loop over a model's 7 x L projections: what a step pays for
`--enable-lora` beside the model, and two other forms of the same product measured against it.

- `stacks`: `layers.LoraStack` as served: two `dense` dots per projection over all slots, a mask between.
- `cond`: each stack under `lax.cond(any token has an adapter)`: timed with no adapter token and with one.
- `shared-input`: one shrinking dot for the projections that read the same input (q, k, v; gate, up).

    python benchmarks/lora_stacks.py --slots 1 4 --rows 1 16 --dtype bfloat16
"""

import argparse
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.model_configs import bundled_config_values
from jaxserve.models.layers import LoraShape, LoraStack, dense
from jaxserve.ops.attention import AttentionConfig, resolve_attention


def projections(config: dict) -> list[tuple[str, int, int]]:
    """(input group, in, out) of a Llama-family layer's seven projections."""
    d, f = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or d // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    return [("x", d, q), ("x", d, kv), ("x", d, kv), ("attn", q, d), ("h", d, f), ("h", d, f), ("mlp", f, d)]


def median_ms(fn, *args, repeats: int = 30) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def measure(slots: int, rows_list: list[int], rank: int, shapes: list[tuple[str, int, int]], layers: int,
            attention: AttentionConfig, dtype: Any, rng: np.random.Generator) -> None:
    """Prints each form's time at `slots` slots, for each row count."""
    shape = LoraShape(slots, rank)
    groups, built = [], []
    for _ in range(layers):
        for group, d_in, d_out in shapes:
            stack = LoraStack(d_in, d_out, shape, dtype, attention)
            stack.lora_a[...] = jnp.asarray(rng.normal(size=stack.lora_a.shape), dtype)
            stack.lora_b[...] = jnp.asarray(rng.normal(size=stack.lora_b.shape), dtype)
            groups.append(group)
            built.append(stack)
    graphdef, state = nnx.split(nnx.List(built))  # weights as arguments, as the step takes them

    def merged(state):
        return list(zip(groups, nnx.merge(graphdef, state), strict=True))

    def served(state, inputs, token_slots):
        return sum(stack(inputs[group], token_slots).sum() for group, stack in merged(state))

    def under_cond(state, inputs, token_slots):
        any_adapter = jnp.any(token_slots >= 0)
        total = 0.0
        for group, stack in merged(state):
            x = inputs[group]
            zeros = jnp.zeros((x.shape[0], stack.lora_b.shape[-1]), x.dtype)
            total += jax.lax.cond(any_adapter, lambda x, s, stack=stack: stack(x, s),
                                  lambda x, s, zeros=zeros: zeros, x, token_slots).sum()
        return total

    # The shared-input form keeps each group's A side by side in one array, built once (as a model would).
    widths = [("x", 3), ("attn", 1), ("h", 2), ("mlp", 1)] * layers
    starts = np.cumsum([0] + [width for _, width in widths])
    joined = [jnp.concatenate([stack.lora_a[...].reshape(stack.lora_a.shape[0], -1)
                               for stack in built[start : start + width]], axis=1)
              for start, (_, width) in zip(starts, widths, strict=False)]

    def shared_input(state, joined, inputs, token_slots):
        stacks = merged(state)
        total = 0.0
        for (group, width), start, a in zip(widths, starts, joined, strict=False):
            members = [stack for _, stack in stacks[start : start + width]]
            x = inputs[group]
            shrunk = dense(x, a, attention).reshape(x.shape[0], width, slots, rank)
            mine = token_slots[:, None] == jnp.arange(slots)[None, :]
            shrunk = jnp.where(mine[:, None, :, None], shrunk, 0)
            for i, member in enumerate(members):
                b = member.lora_b[...]
                total += dense(shrunk[:, i].reshape(x.shape[0], -1), b.reshape(-1, b.shape[-1]),
                               attention).sum()
        return total

    for rows in rows_list:
        inputs = {group: jnp.ones((rows, d_in), jnp.float32) for group, d_in, _ in shapes}
        with_adapter = jnp.zeros(rows, jnp.int32)
        base_only = jnp.full(rows, -1, jnp.int32)
        figures = {
            "stacks": median_ms(jax.jit(served), state, inputs, with_adapter),
            "cond, no adapter": median_ms(jax.jit(under_cond), state, inputs, base_only),
            "cond, an adapter": median_ms(jax.jit(under_cond), state, inputs, with_adapter),
            "shared-input": median_ms(jax.jit(shared_input), state, joined, inputs, with_adapter),
        }
        print(f"{slots} slot(s), {rows:>3} rows: " + ", ".join(f"{k} {v:.2f} ms" for k, v in figures.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="a bundled shape (default: smollm2-135m)")
    parser.add_argument("--slots", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    config = bundled_config_values(args.model)
    layers, shapes = config["num_hidden_layers"], projections(config)
    attention = resolve_attention("auto")
    dtype = jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)
    print(f"{args.model}: {layers} layers x 7 projections, rank {args.rank}, {args.dtype}, {attention.impl}")
    for slots in args.slots:
        measure(slots, args.rows, args.rank, shapes, layers, attention, dtype, rng)

if __name__ == "__main__":
    main()
