"""The lowered program of every step variant for the bundled model (dequantized), hashed: a change that must
leave the step alone gives the same hashes before and after it. Run it from each checkout:

    git worktree add /tmp/old <commit>; cd /tmp/old && PYTHONPATH=. python /path/to/benchmarks/step_program_hash.py
    cd <this checkout> && python benchmarks/step_program_hash.py

TP=2 (with XLA_FLAGS=--xla_force_host_platform_device_count=2 on a CPU) hashes the steps split over two devices.
"""

import hashlib
import os

import jax

from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.models.loader import bundled_model_path
from jaxserve.runner.aot import abstract_step_args
from jaxserve.runner.buckets import Bucket

config = EngineConfig.from_preset(None, model=str(bundled_model_path()), quantization="none", dtype="float32",
                                  token_buckets=(16,), request_buckets=(1, 2), max_num_seqs=2,
                                  max_num_batched_tokens=16, num_kv_pages=64, max_model_len=256,
                                  compilation_cache_dir=None, tensor_parallel_size=int(os.environ.get("TP", "1")))
engine = LLMEngine(config, warmup=False)
runner = engine.core.runner if hasattr(engine, "core") else engine.engine_core.runner
for name, step in runner._step_fns.items():
    multi = getattr(name, "multi_step", False)
    for bucket in ((Bucket(2, 2, decode_only=True),) if multi else (Bucket(16, 2), Bucket(2, 2, decode_only=True))):
        args = abstract_step_args(runner.model.state, runner._step_shapes, bucket, jax.devices()[0], runner.mesh,
                                  multi)
        text = step.trace(*args).lower().as_text()
        print(name, bucket, hashlib.sha256(text.encode()).hexdigest()[:16], len(text))
