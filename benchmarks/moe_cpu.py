"""A mixture of experts' MLP on a CPU: the native grouped matmuls (`cpu_kernels.grouped_matmul_bf16`, and
`grouped_matmul_gguf` on experts kept in GGUF blocks: Q4_0, Q2_K .. Q6_K or IQ4_XS) against
`jax.lax.ragged_dot`, which XLA:CPU computes densely (every row against every expert), side by side.

One layer's routed experts in a model's shapes (`--model`, a bundled config: Qwen3-30B-A3B by default, 128
experts of 2,048 x 768, 8 a token), bfloat16 weights, random router logits, for T tokens a step
(`--tokens`: 1 to 16 are decodes, 256 a prefill chunk). Each case runs `--copies` layers back to back in
one jitted function, each taking the one before's output, so the experts come from memory as in a served
step. Reports the median time per layer over alternating rounds, and for the native kernels the GB/s of the
experts they read (those the routing hit, each once: 2 bytes a weight in bfloat16, 0.5625 in Q4_0 and Q4_K,
0.6875 in Q5_K, 0.8203 in Q6_K, 0.5313 in IQ4_XS, 0.4297 in Q3_K, 0.3281 in Q2_K). The blocks hold random codes
under float16 scales of a real file's size.

    python benchmarks/moe_cpu.py --tokens 1 4 16 64 256 --rounds 2
    python benchmarks/moe_cpu.py --impls "native bf16" "native Q4_0" "native Q4_K" "native Q5_K" "native Q6_K" \
        --tokens 1 16
"""

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from lora_stacks import median_ms  # this directory's

from jaxserve.model_configs import bundled_config_values
from jaxserve.models.gguf_weights import GgufExperts, GgufTensor
from jaxserve.models.moe import grouped_expert_mlp, route
from jaxserve.platform import prepare_jax_platform


def layers_fn(copies: int, top_k: int, num_experts: int, native: bool):
    @jax.jit
    def run(x, logits, gates, ups, downs):  # x bf16[T, D]; logits f32[L, T, E]; L layers' experts [E, ...]
        for layer in range(copies):
            weights, experts = route(logits[layer], top_k, True)
            out = grouped_expert_mlp(x, weights, experts, gates[layer], ups[layer], downs[layer],
                                     num_experts=num_experts, native=native)
            x = (x.astype(jnp.float32) + out).astype(jnp.bfloat16)
        return x

    return run


# A format's float16 scales in a block: where they lie, their value (a block's weights and bytes are the gguf
# package's GGML_QUANT_SIZES).
BLOCKS = {"Q4_0": ((0,), 0.002), "Q4_K": ((0, 2), 0.0005), "Q5_K": ((0, 2), 0.0003), "Q6_K": ((208,), 0.0001),
          "IQ4_XS": ((0,), 0.0001), "Q3_K": ((108,), 0.0003), "Q2_K": ((80, 82), 0.0005)}
IMPLS = ("ragged_dot", "native bf16", *(f"native {kind}" for kind in BLOCKS))


def random_experts(rng: np.random.Generator, kind: str, num_experts: int, k: int, n: int) -> GgufExperts:
    """Experts [E, K, N] in `kind`'s blocks of random codes (stored [E, N, K / weights * bytes])."""
    (weights, size), (scales, value) = GGML_QUANT_SIZES[GGMLQuantizationType[kind]], BLOCKS[kind]
    blocks = rng.integers(0, 256, size=(num_experts, n, k // weights, size), dtype=np.uint8)
    for at in scales:
        blocks[..., at: at + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)
    return GgufTensor(blocks.reshape(num_experts, n, -1), kind).as_experts((num_experts, k, n))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-30b-a3b", help="a bundled config with experts")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--copies", type=int, default=4, help="layers per call (their experts are distinct)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3, help="timed calls per case and round")
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS[:3]))
    args = parser.parse_args()
    prepare_jax_platform()
    values = bundled_config_values(args.model)
    d, f = values["hidden_size"], values["moe_intermediate_size"]
    e, k = values["num_experts"], values["num_experts_per_tok"]
    rng = np.random.default_rng(0)
    key = jax.random.key(0)
    draw = functools.partial(jax.random.normal, dtype=jnp.bfloat16)
    # Separate arrays a layer, as the model holds them: a slice of one stacked array would be copied out
    # for the kernel's call.
    keys = iter(jax.random.split(key, 3 * args.copies))
    gates = [draw(next(keys), (e, d, f)) * 0.02 for _ in range(args.copies)]
    ups = [draw(next(keys), (e, d, f)) * 0.02 for _ in range(args.copies)]
    downs = [draw(next(keys), (e, f, d)) * 0.02 for _ in range(args.copies)]
    native, dense = layers_fn(args.copies, k, e, True), layers_fn(args.copies, k, e, False)
    impls = {"ragged_dot": (dense, (gates, ups, downs)), "native bf16": (native, (gates, ups, downs))}
    expert_bytes = {"native bf16": 3 * d * f * 2}
    for kind in BLOCKS:
        if f"native {kind}" in args.impls:
            layers = tuple([random_experts(rng, kind, e, d_in, d_out) for _ in range(args.copies)]
                           for d_in, d_out in ((d, f), (d, f), (f, d)))  # gates, ups, downs: each a list
            impls[f"native {kind}"] = (native, layers)
            weights, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
            expert_bytes[f"native {kind}"] = 3 * d * f * size / weights
    impls = {name: impls[name] for name in args.impls}
    natives = [name for name in args.impls if name != "ragged_dot"]
    base = args.impls[0]  # the ratios' baseline
    print(f"{args.model}: {e} experts of {d} x {f}, {k} a token; {args.copies} layers a call\n")
    print("| tokens | experts hit | " + " | ".join(f"{name} ms/layer" for name in args.impls)
          + "".join(f" | {base} / {name}" for name in args.impls[1:])
          + "".join(f" | {name} GB/s" for name in natives) + " |")
    print("|---|---|" + "---|" * (2 * len(args.impls) - 1 + len(natives)))
    for tokens in args.tokens:
        x = jnp.asarray(rng.standard_normal((tokens, d)), jnp.bfloat16)
        logits = jnp.asarray(rng.standard_normal((args.copies, tokens, e)), jnp.float32)
        hit = np.mean([len(np.unique(np.argsort(-np.asarray(logits[i]), axis=1)[:, :k])) for i in range(args.copies)])
        per_round = {name: [] for name in impls}
        for _ in range(args.rounds):
            for name, (fn, experts) in impls.items():
                per_round[name].append(median_ms(fn, x, logits, *experts, repeats=args.runs) / 1e3 / args.copies)
        times = {name: float(np.median(values)) for name, values in per_round.items()}
        row = [f"{tokens}", f"{hit:.0f}", *(f"{times[name] * 1e3:.2f}" for name in args.impls)]
        row += [f"{times[base] / times[name]:.2f}" for name in args.impls[1:]]
        row += [f"{hit * expert_bytes[name] / times[name] / 1e9:.1f}" for name in natives]
        print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
