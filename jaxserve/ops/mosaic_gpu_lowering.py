"""What lowering a Mosaic GPU kernel costs in Python, made to follow the kernel alone; and the kernels' shared
`interpret=` rule (`interpreter`).

Mosaic GPU's lowering asks jaxlib for the newest PTX ISA version its ptxas supports at every register
conversion that involves a type of 8 bits or fewer (booleans and FP8 among them), and jaxlib 0.10 and 0.11
answer by running ptxas in a new process each time: about fifty processes for each attention kernel
lowered, a mixed step's Hopper attention once a bucket, at every start (a warm start lowers every step to
find it in the persistent cache). jaxlib 0.12 asks less often and answers faster. The answer cannot change
while a process runs, so it is asked once and remembered (`remember_ptxas_version`). Where a jax lays this
out otherwise, nothing is changed.
"""

import functools
from types import ModuleType
from typing import Any


def interpreter(interpret: bool | Any) -> Any:
    """A Mosaic GPU kernel's `interpret=`: True gives the interpreter's default parameters (jax >= 0.11),
    anything else (False, or parameters) goes as it is."""
    if interpret is not True:
        return interpret
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # jax >= 0.11

    return InterpretGPUParams()


def remember_ptxas_version(extension: ModuleType | None = None) -> bool:
    """Makes `extension._get_ptxas_isa_version` (jaxlib's Mosaic GPU extension, by default) ask ptxas once a
    process, and returns whether it does. A failed query (no ptxas) is not remembered: it fails as before."""
    if extension is None:
        try:
            from jax._src.lib import mosaic_gpu
        except ImportError:  # a jaxlib without Mosaic GPU
            return False
        extension = getattr(mosaic_gpu, "_mosaic_gpu_ext", None)
    query = getattr(extension, "_get_ptxas_isa_version", None)
    if query is None:
        return False
    if not hasattr(query, "cache_info"):  # not remembered yet
        extension._get_ptxas_isa_version = functools.cache(query)
    return True
