"""Warm-up of a classifier's pooling engine (Qwen3's 151,936-token vocabulary, a tiny random stack, token
buckets 16, 64 and 256 by request buckets 1, 4 and 16) with its dropped sample drawn from constant zeros,
which XLA constant-folds the sampler over, or from equal non-constant logits (what jaxserve does). Run once
per variant, in a fresh process, each with an empty compilation cache:
`python -m benchmarks.classifier_warmup MODEL_DIR zeros|equal CACHE_DIR`."""
import json
import sys
import time
from pathlib import Path

import jax.numpy as jnp

directory, variant = Path(sys.argv[1]), sys.argv[2]
directory.mkdir(exist_ok=True)
(directory / "config.json").write_text(json.dumps({
    "architectures": ["Qwen3ForSequenceClassification"], "model_type": "qwen3", "vocab_size": 151936,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
    "num_labels": 1, "tie_word_embeddings": True}))

from jaxserve.llm import LLM  # noqa: E402
from jaxserve.models import _spec  # noqa: E402

if variant == "zeros":
    model_cls = _spec("Qwen3ForSequenceClassification").model_cls
    model_cls.compute_logits = lambda self, hidden: jnp.zeros((hidden.shape[0], self.cfg.vocab_size), jnp.float32)
start = time.perf_counter()
llm = LLM(model=str(directory), load_format="dummy", dtype="float32", max_model_len=256, num_kv_pages=256,
          page_size=16, compilation_cache_dir=sys.argv[3], warmup_mode="full", max_num_seqs=16,
          max_num_batched_tokens=256, token_buckets=(16, 64, 256), request_buckets=(1, 4, 16))
ready = time.perf_counter() - start
print(json.dumps({"variant": variant, "ready_s": round(ready, 2)}))
