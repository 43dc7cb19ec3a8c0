"""Tiny random classifiers (transformers' `*ForSequenceClassification`), saved with the SmolLM2 tokenizer
as the tiny causal models are (`tests/conftest.py`'s `classifier_dir`), for the engine's and the server's
classifier tests."""

import torch

from tests.conftest import TINY_VOCAB

LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def with_pair_separator(tokenizer):
    """A copy of a fast tokenizer whose pair encoding puts `<|im_start|>` between the two texts (its single
    texts' as before): a cross-encoder's prompts then differ from the texts' encodings joined."""
    import copy

    from tokenizers.processors import TemplateProcessing

    paired = copy.deepcopy(tokenizer)
    separator = "<|im_start|>"
    paired.backend_tokenizer.post_processor = TemplateProcessing(
        single="$A", pair=f"$A {separator} $B:1", special_tokens=[(separator, paired.convert_tokens_to_ids(separator))])
    return paired


def classifier(kind: str, num_labels: int, problem_type: str | None = None):
    import transformers

    torch.manual_seed(0)
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForSequenceClassification),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForSequenceClassification),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForSequenceClassification),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForSequenceClassification),
    }[kind]
    labels = LABELS if num_labels == 3 else {0: "relevance"}
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5,
                 tie_word_embeddings=False)
    if kind == "gemma2":  # local, global, local, with soft caps (which the classifier's head does not apply)
        shape.update(head_dim=32, num_hidden_layers=3, query_pre_attn_scalar=24, sliding_window=6,
                     attn_logit_softcapping=3.0, final_logit_softcapping=5.0, tie_word_embeddings=True)
    config = config_class(
        vocab_size=TINY_VOCAB, initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=0, **shape,
        num_labels=num_labels, id2label=labels, label2id={v: k for k, v in labels.items()}, problem_type=problem_type,
    )
    model = model_class(config)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith(".bias"):  # HF zero-initialises biases (Qwen2's q/k/v): random ones are tested
                tensor.normal_(std=0.3)
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                tensor.normal_(mean=1.0, std=0.3)
            if kind == "gemma2" and name.endswith("norm.weight"):  # Gemma's (1 + w) norms start at zeros
                tensor.normal_(std=0.3)
    return model.eval()
