"""jaxserve: a JAX-native LLM inference engine and server."""

__version__ = "0.1.0"

from jaxserve.llm import LLM
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__"]
