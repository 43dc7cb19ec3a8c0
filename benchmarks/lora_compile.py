"""What `--enable-lora` adds to the GPU step, deviceless: one decode bucket of a bundled shape compiled for a
target (default: an H100) without LoRA and with 1 and 4 slots, every decode variant the gpu preset turns
on; per variant, the kernels XLA launches and what the host runs (`jaxserve compile`'s launches table).

    python benchmarks/lora_compile.py --model smollm2-135m --target h100
"""

import argparse

from jaxserve.device import use_cpu_platform


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--target", default="h100")
    parser.add_argument("--rows", type=int, default=16, help="the decode bucket's sequences (default: 16)")
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    use_cpu_platform()  # before jax starts a backend: the compiles are deviceless
    from jaxserve.compile_ladder import compile_ladder
    from jaxserve.models.layers import LoraShape
    from jaxserve.runner.buckets import Bucket

    for lora in (None, LoraShape(1, args.rank), LoraShape(4, args.rank)):
        report = compile_ladder(args.model, target=args.target, preset="gpu", dtype="bfloat16", xla_cost=False,
                                buckets=[Bucket(args.rows, args.rows, decode_only=True)], num_kv_pages=100_000,
                                lora=lora)
        slots = f"{lora.max_loras} slot(s)" if lora else "no LoRA"
        for row in report.buckets:
            launches = row.launches
            print(f"{slots:<10} {row.variant:<18} kernels {launches.num_kernels:>5}  host ops "
                  f"{launches.num_host_ops} {dict(launches.host_ops)}  in command buffers {launches.graph_share:.0%}"
                  f"  weights {report.weights_bytes / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
