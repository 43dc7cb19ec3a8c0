"""Tokenizers and chat templates, from HF files or GGUF metadata (both through transformers)."""

from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

# Used only when a model ships no chat template (GPT-2, base models): plain "role: content" turns.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def load_tokenizer(model_dir: Path, gguf_file: str | None = None) -> Any:
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), **kwargs)
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = FALLBACK_CHAT_TEMPLATE
    return tokenizer


def is_fallback_template(tokenizer: Any) -> bool:
    """Whether `tokenizer`'s chat template is jaxserve's fallback: the model ships none."""
    return getattr(tokenizer, "chat_template", None) == FALLBACK_CHAT_TEMPLATE


def apply_chat_template(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Renders a conversation and tokenizes it (the template supplies any special tokens)."""
    if not messages:
        raise ValueError("messages must not be empty")
    text = tokenizer.apply_chat_template(
        messages, chat_template=chat_template, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)
