"""Registers, spills and static shared memory of the Mosaic GPU paged kernel's configurations, on a Hopper GPU
or, with jax >= 0.12, compiled for an H100 without one.

This runs each configuration once (Llama-3-8B heads, bfloat16 or an FP8 cache, a 256-token prefill beside
decodes, or decodes alone) in a child process with MOSAIC_GPU_DUMP_PTX set, which prints each kernel's PTX
as Mosaic GPU compiles it, and assembles that PTX with `ptxas -v` for sm_90a (`jaxserve.bench.ptxas`). On a
machine without a GPU (`--deviceless`, the default there) the child compiles each configuration for a
deviceless H100 instead of running it: jaxlib 0.12 compiles a Mosaic GPU kernel with the executable (0.10
and 0.11 only when it is loaded on a GPU, so they print nothing here). A warpgroup-
specialised kernel sets its registers per warpgroup at run time (`setmaxnreg`), so what counts here is the
spills: a configuration that spills pays for it in local-memory traffic on every step. The machine's
ptxas assembles the PTX, not the compiler library jaxlib links, so a count may differ from the running
kernel's by a version's register allocation.

    python benchmarks/mosaic_registers.py                # on a Hopper GPU (about 30 s): a table on stdout
    python benchmarks/mosaic_registers.py --timeout 300  # without one, deviceless (jax >= 0.12; a few minutes)
"""

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

MARKER = "@@ configuration "
# (name, decode-only, the kernel's keywords): the prefill default (ping-pong) and the schedules beside it, P
# through shared memory; the decode default and its overlapped softmax; with an FP8 cache ("FP8" in the
# name), the settings `config_for` gives it
CONFIGS = [
    ("prefill without ping-pong", False, dict(num_consumers=2, block_kv=128, stages=2, p_in_registers=True)),
    ("prefill default (ping-pong)", False, dict(num_consumers=2, block_kv=128, stages=2, p_in_registers=True,
                                                ping_pong=True)),
    ("prefill persistent grid (ping-pong)", False, dict(num_consumers=2, block_kv=128, stages=2, p_in_registers=True,
                                                        ping_pong=True, programs_per_kv_head=16)),
    ("prefill overlap", False, dict(num_consumers=2, block_kv=128, stages=2, p_in_registers=True, overlap=True)),
    ("prefill ping-pong + overlap", False, dict(num_consumers=2, block_kv=128, stages=2, p_in_registers=True,
                                                ping_pong=True, overlap=True)),
    ("prefill P in smem", False, dict(num_consumers=2, block_kv=128, stages=2, p_in_registers=False)),
    ("prefill P in smem + overlap", False, dict(num_consumers=2, block_kv=128, stages=2, p_in_registers=False,
                                                overlap=True)),
    ("prefill 1 consumer + overlap", False, dict(num_consumers=1, block_kv=128, stages=2, p_in_registers=True,
                                                 overlap=True)),
    ("decode default", True, dict(num_consumers=1, block_kv=128, stages=2)),
    ("decode P in registers", True, dict(num_consumers=1, block_kv=128, stages=2, p_in_registers=True)),
    ("decode overlap", True, dict(num_consumers=1, block_kv=128, stages=2, overlap=True)),
    ("decode overlap, P in registers", True, dict(num_consumers=1, block_kv=128, stages=2, p_in_registers=True,
                                                  overlap=True)),
    ("prefill FP8 (ping-pong)", False, dict(num_consumers=2, block_kv=64, stages=2, p_in_registers=True,
                                            ping_pong=True)),
    ("decode FP8", True, dict(num_consumers=1, block_kv=64, stages=2)),
    ("decode FP8, 3 stages", True, dict(num_consumers=1, block_kv=64, stages=3)),
    ("decode FP8, 128 keys, P in registers", True, dict(num_consumers=1, block_kv=128, stages=2, p_in_registers=True)),
]


def run_each_configuration(deviceless: bool, names: list[str] | None) -> None:
    """The child: each configuration compiled and run once (or with `deviceless`, compiled for an H100),
    after a marker line naming it."""
    from jaxserve.device import deviceless_device, use_cpu_platform
    from jaxserve.platform import prepare_jax_platform

    prepare_jax_platform()
    if deviceless:
        use_cpu_platform()  # before a backend starts: a deviceless compile needs the CPU as the platform
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.ops.paged_attention_mgpu import ragged_paged_attention_mgpu
    from jaxserve.parallel import on_one_device

    num_q_heads, num_kv_heads, head_dim, page_size = 32, 8, 128, 16
    rng = np.random.default_rng(0)
    placed = on_one_device(deviceless_device("h100")) if deviceless else None

    def inputs(q_lens: list[int], kv_lens: list[int], cache_dtype) -> tuple:
        pages_per_req = -(-max(kv_lens) // page_size)
        num_pages = pages_per_req * len(kv_lens)
        arrays = (rng.standard_normal((sum(q_lens), num_q_heads, head_dim)),
                  *[rng.standard_normal((num_kv_heads, num_pages, page_size, head_dim))] * 2,
                  np.asarray(kv_lens), np.arange(num_pages).reshape(len(kv_lens), pages_per_req),
                  np.cumsum([0, *q_lens]))
        dtypes = (jnp.bfloat16, cache_dtype, cache_dtype, jnp.int32, jnp.int32, jnp.int32)
        if deviceless:
            return tuple(jax.ShapeDtypeStruct(a.shape, d, sharding=placed) for a, d in zip(arrays, dtypes, strict=True))
        return tuple(jnp.asarray(a, d) for a, d in zip(arrays, dtypes, strict=True))

    for name, decode_only, config in CONFIGS:
        if names and name not in names:
            continue
        print(f"{MARKER}{name}", flush=True)
        cache_dtype = jnp.float8_e4m3fn if "FP8" in name else jnp.bfloat16
        args = inputs([1] * 16, [700] * 16, cache_dtype) if decode_only else inputs([256] + [1] * 8, [256] + [500] * 8,
                                                                                     cache_dtype)
        try:
            fn = jax.jit(lambda *a, c=config: ragged_paged_attention_mgpu(*a, sm_scale=head_dim**-0.5, **c))
            if deviceless:
                fn.trace(*args).lower(lowering_platforms=("cuda",)).compile()
            else:
                jax.block_until_ready(fn(*args))
        except Exception as error:  # reported; the next configuration goes on
            print(f"@@ error {type(error).__name__}: {str(error)[:300]}", flush=True)
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="the rows as JSON here too (the table goes to stdout)")
    parser.add_argument("--timeout", type=float, default=50, help="seconds for it all (at least 10): four "
                        "fifths for the compiles, the rest for ptxas; what is done by then is reported")
    parser.add_argument("--deviceless", action=argparse.BooleanOptionalAction, default=None,
                        help="compile each configuration for an H100 instead of running it (jax >= 0.12; the "
                        "default without a GPU)")
    parser.add_argument("--configs", nargs="+", choices=[name for name, _, _ in CONFIGS], metavar="NAME",
                        help="only these configurations (default: all)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return run_each_configuration(args.deviceless, args.configs)
    if args.deviceless is None:
        from jaxserve.platform import nvidia_gpu_visible

        args.deviceless = not nvidia_gpu_visible()
    from jaxserve.bench.ptxas import find_ptxas, ptx_modules, ptxas_figures

    deadline = time.monotonic() + max(args.timeout, 10)
    env = dict(os.environ, MOSAIC_GPU_DUMP_PTX="1")
    env.pop("MOSAIC_GPU_DUMP_TO", None)  # it would send the PTX to files
    try:
        mode = ["--deviceless" if args.deviceless else "--no-deviceless", *(["--configs", *args.configs]
                                                                             if args.configs else [])]
        child = subprocess.run([sys.executable, __file__, "--child", *mode], env=env, capture_output=True,
                               timeout=0.8 * max(args.timeout, 10))
        stdout, stderr, status = child.stdout, child.stderr, f"exited {child.returncode}"
    except subprocess.TimeoutExpired as late:  # what it printed by then still counts
        stdout, stderr, status = late.stdout or b"", late.stderr or b"", f"stopped after {late.timeout:.0f} s"
    stdout, stderr = stdout.decode(errors="replace"), stderr.decode(errors="replace")
    ptxas = find_ptxas()
    print(f"ptxas: {ptxas}; the child {status}{' (deviceless, for an H100)' if args.deviceless else ''}")
    if not status.endswith(" 0"):
        print(stderr[-3000:])
    print("| configuration | registers | spill stores | spill loads | stack | static smem | PTX assembled as | error |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for section in stdout.split(MARKER)[1:]:
        name, _, output = section.partition("\n")
        error = next((line for line in output.splitlines() if line.startswith("@@ error")), "")
        modules = ptx_modules(output)
        try:
            figures = [f for module in modules for f in ptxas_figures(module, ptxas=ptxas,
                                                                      timeout=deadline - time.monotonic())]
        except (RuntimeError, subprocess.TimeoutExpired) as failure:
            figures, error = [], error or str(failure)[:300]
        if not figures:
            error = error or f"no PTX printed ({len(modules)} modules)"
        for f in figures or [None]:
            rows.append(dict(configuration=name, error=error, **(asdict(f) if f else {})))
            cells = ([f.registers, f.spill_store_bytes, f.spill_load_bytes, f.stack_bytes, f.smem_bytes,
                      f.ptx_version or "written"] if f else ["-"] * 6)
            print(f"| {name} | " + " | ".join(map(str, cells)) + f" | {error} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
