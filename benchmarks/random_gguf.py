"""Random weights as llama.cpp's GGUF files hold them, for the random-model GGUFs of the speed runs against
llama-server (`random_qwen3_gguf.py`, `random_deepseek_gguf.py`)."""

import numpy as np


def random_tensor(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Norms are float32 ones (llama.cpp keeps norms in float32); every other tensor float16 of std 0.02."""
    if name.endswith("norm.weight"):
        return np.ones(shape, np.float32)
    return (rng.standard_normal(shape, np.float32) * 0.02).astype(np.float16)
