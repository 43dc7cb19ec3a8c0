"""Whether Pallas' Mosaic GPU backend compiles an Ampere kernel for an A100 here, without a GPU: the port the
Triton kernels (jaxserve's attention on sm_80 and sm_89) need once jax removes Pallas' Triton backend.

The probe is a small kernel built from what an attention block on sm_80 is made of:
- `cp.async` copies from global to shared memory (`copy_gmem_to_smem` without a barrier, awaited with
  `wait_gmem_to_smem`);
- one `mma.sync` matrix product (`plgpu.mma`, bfloat16 in, float32 out);
- a store from registers to global memory.

It compiles that kernel for a deviceless A100, through XLA and ptxas. Nothing runs. Mosaic GPU reads the
architecture from the default device while it lowers; without one it assumes sm_90. So the compile runs
under `jax.default_device(<the deviceless A100>)`. For contrast, the same kernel is also compiled for an H100,
where `cp.async` copies are refused (Hopper copies through TMA, with a barrier).

    python benchmarks/mosaic_gpu_ampere.py      # jax >= 0.12 and the gpu-compile extra; about 10 s
"""

import sys

M = N = K = 64  # one 64 x 64 block: the probe is whether it compiles, not how fast it runs


def compile_probe(target: str) -> str:
    """'compiled', or the first line of why not, for `target` ('a100', 'h100')."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from jaxserve.device import deviceless_device
    from jaxserve.parallel import on_one_device

    def body(a_gmem, b_gmem, out_gmem):
        def scoped(a_smem, b_smem):
            for source, destination in ((a_gmem, a_smem), (b_gmem, b_smem)):
                plgpu.copy_gmem_to_smem(source, destination, oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)
            plgpu.wait_gmem_to_smem(0)
            out_gmem[...] = plgpu.mma(jnp.zeros((M, N), jnp.float32), a_smem[...], b_smem[...])

        pl.run_scoped(scoped, plgpu.SMEM((M, K), jnp.bfloat16), plgpu.SMEM((K, N), jnp.bfloat16))

    @jax.jit
    def product(a, b):  # a: [M, K] bf16, b: [K, N] bf16 -> [M, N] f32
        return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((M, N), jnp.float32))(a, b)

    device = deviceless_device(target)
    placed = on_one_device(device)
    a, b = (jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=placed) for shape in ((M, K), (K, N)))
    try:
        with jax.default_device(device):  # the architecture Mosaic GPU lowers for
            product.trace(a, b).lower().compile()
    except Exception as error:  # what jax says is the finding
        return f"not compiled: {type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}"
    return "compiled"


def main() -> int:
    from jaxserve.device import use_cpu_platform
    from jaxserve.platform import prepare_jax_platform

    prepare_jax_platform()
    use_cpu_platform()  # before a backend starts: a deviceless compile needs the CPU as the platform
    import jax

    if jax.__version_info__ < (0, 12):
        print(f"jax {jax.__version__}: Mosaic GPU's Ampere path needs jax >= 0.12")
        return 1
    results = {target: compile_probe(target) for target in ("a100", "h100")}
    for target, result in results.items():
        print(f"jax {jax.__version__}, {target}: cp.async loads, mma.sync, register stores: {result}")
    return 0 if results["a100"] == "compiled" else 1


if __name__ == "__main__":
    sys.exit(main())
