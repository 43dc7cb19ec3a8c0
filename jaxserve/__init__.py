"""jaxserve: a JAX-native LLM inference engine and server."""

import time
from typing import Any

from jaxserve.config import LoRARequest
from jaxserve.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    CompletionOutput,
    EmbeddingRequestOutput,
    Logprob,
    RequestOutput,
    RequestOutputKind,
    ScoringRequestOutput,
)
from jaxserve.sampling_params import BeamSearchParams, SamplingParams

__version__ = "0.1.0"
IMPORTED_AT = time.monotonic()  # start-up logs count from here: the first thing a jaxserve process imports
__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "LoRARequest",
    "Logprob",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "ScoringRequestOutput",
    "__version__",
]


def __getattr__(name: str) -> Any:
    # `LLM` pulls in jax; importing it lazily keeps `import jaxserve.engine.scheduler` jax-free.
    if name == "LLM":
        from jaxserve.llm import LLM

        return LLM
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
