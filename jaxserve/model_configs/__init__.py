"""Model shapes shipped with the package (HF config.json values, no weights), so `jaxserve compile` and the
GPU compile tests need neither a download nor the hub. No jax here: the CLI lists the names."""

import importlib.resources
import json
from typing import Any

BUNDLED_SHAPES = {"gpt2": "gpt2.json", "smollm2-135m": "smollm2-135m.json", "llama-3.2-1b": "llama-3.2-1b.json",
                  "llama-3-8b": "llama-3-8b.json", "qwen3-0.6b": "qwen3-0.6b.json", "gemma-2-2b": "gemma-2-2b.json",
                  "gemma-3-1b": "gemma-3-1b.json", "phi-3-mini-4k": "phi-3-mini-4k.json",
                  "qwen3-30b-a3b": "qwen3-30b-a3b.json", "mixtral-8x7b": "mixtral-8x7b.json",
                  "qwen1.5-moe-a2.7b": "qwen1.5-moe-a2.7b.json", "granite-3.1-2b": "granite-3.1-2b.json",
                  "smollm3-3b": "smollm3-3b.json", "olmo-2-1b": "olmo-2-1b.json", "gemma-2b": "gemma-2b.json",
                  "gpt-oss-20b": "gpt-oss-20b.json", "deepseek-v2-lite": "deepseek-v2-lite.json",
                  "deepseek-v3": "deepseek-v3.json",
                  "glm-4.5-air": "glm-4.5-air.json", "all-minilm-l6-v2": "all-minilm-l6-v2.json",
                  "bge-reranker-base": "bge-reranker-base.json"}


def bundled_config_values(name: str) -> dict[str, Any]:
    """The config.json values of a bundled shape (comment keys dropped)."""
    text = (importlib.resources.files("jaxserve") / "model_configs" / BUNDLED_SHAPES[name]).read_text()
    return {k: v for k, v in json.loads(text).items() if not k.startswith("_")}
