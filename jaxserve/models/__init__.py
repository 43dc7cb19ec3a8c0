"""Model registry: the HF `architectures` name -> the module that implements it.

Each model module exposes a `*Config.from_hf(hf_config, attention)`, the NNX model class, and
`map_hf_weight(name, cfg)`, its HF checkpoint name map; a module whose checkpoints hold tensors otherwise than
the model does (fused, or one per expert) also exposes `hf_weight_stream(tensors, cfg)`, and one whose
parameters split over a mesh by the config, `split_rule(name, cfg)`.
"""

import importlib
from dataclasses import dataclass
from functools import cache
from types import ModuleType
from typing import Any


@dataclass(frozen=True)
class ModelSpec:
    module: ModuleType
    config_cls: type
    model_cls: type


# Architecture -> (module, config class, model class). A family's module (and with it jax and flax) is
# imported when a model of that family is asked for, so that the package's jax-free modules (`source`,
# `gguf_cache`) stay jax-free for the server's front end.
_FAMILIES: dict[str, tuple[str, str, str]] = {
    "GPT2LMHeadModel": ("gpt2", "GPT2Config", "GPT2LMHeadModel"),
    "LlamaForCausalLM": ("llama", "LlamaConfig", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaConfig", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaConfig", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "LlamaConfig", "LlamaForCausalLM"),
    "Phi3ForCausalLM": ("llama", "LlamaConfig", "LlamaForCausalLM"),
    "MixtralForCausalLM": ("llama", "LlamaConfig", "LlamaForCausalLM"),
    "Qwen3MoeForCausalLM": ("llama", "LlamaConfig", "LlamaForCausalLM"),
    "Qwen2MoeForCausalLM": ("llama", "LlamaConfig", "LlamaForCausalLM"),
    "GraniteForCausalLM": ("llama", "LlamaConfig", "LlamaForCausalLM"),
    "GraniteMoeForCausalLM": ("llama", "LlamaConfig", "LlamaForCausalLM"),
    "GraniteMoeSharedForCausalLM": ("llama", "LlamaConfig", "LlamaForCausalLM"),
    "SmolLM3ForCausalLM": ("llama", "LlamaConfig", "LlamaForCausalLM"),
    "Olmo2ForCausalLM": ("llama", "LlamaConfig", "LlamaForCausalLM"),
    "Olmo3ForCausalLM": ("llama", "LlamaConfig", "LlamaForCausalLM"),
    "OlmoeForCausalLM": ("llama", "LlamaConfig", "LlamaForCausalLM"),
    "GemmaForCausalLM": ("gemma", "GemmaConfig", "GemmaForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepseek", "DeepseekConfig", "DeepseekForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek", "DeepseekConfig", "DeepseekForCausalLM"),
    "Glm4ForCausalLM": ("llama", "LlamaConfig", "LlamaForCausalLM"),
    "Glm4MoeForCausalLM": ("llama", "LlamaConfig", "LlamaForCausalLM"),
    "GptOssForCausalLM": ("llama", "LlamaConfig", "LlamaForCausalLM"),
    "Gemma2ForCausalLM": ("gemma", "GemmaConfig", "GemmaForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "GemmaConfig", "GemmaForCausalLM"),
    # Encoders (embedding models and cross-encoders; served by --runner pooling): `bert.py`
    **{f"{family}{task}": ("bert", "BertConfig", "BertModel") for family in ("Bert", "Roberta", "XLMRoberta")
       for task in ("Model", "ForSequenceClassification")},
}
# Sequence classifiers (cross-encoder rerankers, reward and classification models; served by --runner pooling):
# the causal family's stack with a classifier for a head (`classifier.py`)
_CLASSIFIERS: dict[str, str] = {
    "LlamaForSequenceClassification": "LlamaForCausalLM",
    "MistralForSequenceClassification": "MistralForCausalLM",
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
    "Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
    "GemmaForSequenceClassification": "GemmaForCausalLM",
    "Gemma2ForSequenceClassification": "Gemma2ForCausalLM",
    "Gemma3TextForSequenceClassification": "Gemma3ForCausalLM",
}


def values_are_keys(cfg: Any) -> bool:
    """Whether a model's attention reads its values from its keys, so that its cache keeps one array of pages a
    layer, not two (DeepSeek's latent cache: `models.deepseek`); its config says so (`values_are_keys`). Here,
    without jax, for the roofline as well as the cache."""
    return bool(getattr(cfg, "values_are_keys", False))


def kv_arrays(cfg: Any) -> int:
    """Arrays of pages a layer's cache keeps: K and V, or K alone (`values_are_keys`)."""
    return 1 if values_are_keys(cfg) else 2


def is_encoder(cfg: Any) -> bool:
    """Whether a model config is an encoder's (`models.bert`): it reads a prompt whole and both ways, and serves
    pooled vectors only."""
    return bool(getattr(cfg, "is_encoder", False))


def supported_architectures() -> list[str]:
    return sorted([*_FAMILIES, *_CLASSIFIERS])


@cache
def _spec(architecture: str) -> ModelSpec:
    if architecture in _CLASSIFIERS:
        from jaxserve.models.classifier import sequence_classifier

        causal = _spec(_CLASSIFIERS[architecture])
        return ModelSpec(causal.module, causal.config_cls, sequence_classifier(causal.model_cls))
    module_name, config_name, model_name = _FAMILIES[architecture]
    module = importlib.import_module(f"{__name__}.{module_name}")
    return ModelSpec(module, getattr(module, config_name), getattr(module, model_name))


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
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "granite": "GraniteForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",
    "granitemoeshared": "GraniteMoeSharedForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "olmo3": "Olmo3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "bert": "BertModel",
    "roberta": "RobertaModel",
    "xlm-roberta": "XLMRobertaModel",
}


def get_model_spec(hf_config: Any) -> ModelSpec:
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if not architectures and getattr(hf_config, "model_type", None) in _ARCHITECTURE_OF_MODEL_TYPE:
        architectures = [_ARCHITECTURE_OF_MODEL_TYPE[hf_config.model_type]]
    for name in architectures:
        if name in _FAMILIES or name in _CLASSIFIERS:
            return _spec(name)
    raise ValueError(
        f"unsupported model architecture {architectures or '(none given)'}; "
        f"jaxserve supports {', '.join(supported_architectures())}"
    )
