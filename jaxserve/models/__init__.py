"""Model registry: the HF `architectures` name -> the module that implements it.

Each model module exposes a `*Config.from_hf(hf_config, attention)`, the NNX model class, and
`map_hf_weight(name, cfg)`, its HF checkpoint name map; a module whose checkpoints hold tensors otherwise than
the model does (fused, or one per expert) also exposes `hf_weight_stream(tensors, cfg)`, and one whose
parameters split over a mesh by the config, `split_rule(name, cfg)`.
"""

from dataclasses import dataclass
from types import ModuleType
from typing import Any

from jaxserve.models import gemma, gpt2, llama


@dataclass(frozen=True)
class ModelSpec:
    module: ModuleType
    config_cls: type
    model_cls: type


_REGISTRY: dict[str, ModelSpec] = {
    "GPT2LMHeadModel": ModelSpec(gpt2, gpt2.GPT2Config, gpt2.GPT2LMHeadModel),
    "LlamaForCausalLM": ModelSpec(llama, llama.LlamaConfig, llama.LlamaForCausalLM),
    "MistralForCausalLM": ModelSpec(llama, llama.LlamaConfig, llama.LlamaForCausalLM),
    "Qwen2ForCausalLM": ModelSpec(llama, llama.LlamaConfig, llama.LlamaForCausalLM),
    "Qwen3ForCausalLM": ModelSpec(llama, llama.LlamaConfig, llama.LlamaForCausalLM),
    "Phi3ForCausalLM": ModelSpec(llama, llama.LlamaConfig, llama.LlamaForCausalLM),
    "MixtralForCausalLM": ModelSpec(llama, llama.LlamaConfig, llama.LlamaForCausalLM),
    "Qwen3MoeForCausalLM": ModelSpec(llama, llama.LlamaConfig, llama.LlamaForCausalLM),
    "Gemma2ForCausalLM": ModelSpec(gemma, gemma.GemmaConfig, gemma.GemmaForCausalLM),
    "Gemma3ForCausalLM": ModelSpec(gemma, gemma.GemmaConfig, gemma.GemmaForCausalLM),
}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


# Configs read from GGUF metadata carry a model_type but no `architectures`.
_ARCHITECTURE_OF_MODEL_TYPE = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}


def get_model_spec(hf_config: Any) -> ModelSpec:
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if not architectures and getattr(hf_config, "model_type", None) in _ARCHITECTURE_OF_MODEL_TYPE:
        architectures = [_ARCHITECTURE_OF_MODEL_TYPE[hf_config.model_type]]
    for name in architectures:
        if name in _REGISTRY:
            return _REGISTRY[name]
    raise ValueError(
        f"unsupported model architecture {architectures or '(none given)'}; "
        f"jaxserve supports {', '.join(supported_architectures())}"
    )
