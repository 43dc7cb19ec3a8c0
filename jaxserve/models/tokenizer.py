"""Tokenizers and chat templates, from HF files or GGUF metadata (both through transformers)."""

import copy
import json
import threading
from pathlib import Path
from typing import Any

from jaxserve.models.template_format import content_texts, resolve_content_format, template_content

# Used only when a model ships no chat template (GPT-2, base models): plain "role: content" turns.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def load_tokenizer(model_dir: Path, gguf_file: str | None = None) -> Any:
    if gguf_file is None and (backend := _generic_backend(model_dir)) is not None:
        tokenizer = backend.from_pretrained(str(model_dir))
    else:
        from transformers import AutoTokenizer

        kwargs = {"gguf_file": gguf_file} if gguf_file else {}
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), **kwargs)
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = FALLBACK_CHAT_TEMPLATE
    return tokenizer


def encode_text(tokenizer: Any, text: str, text_pair: str | None = None, add_special_tokens: bool = True,
                keep_last: int | None = None) -> list[int]:
    """A text's token ids, or a pair's as the tokenizer joins them (its special tokens around and between).
    With `keep_last` (vLLM's truncate_prompt_tokens), at most that many: the text's last tokens, a pair's longer
    text cut first, inside the tokenizer's special tokens (a BERT's [CLS] and [SEP] stay where they are), as
    vLLM's tokenizers truncate (on the left); the ids' last `keep_last` where the special tokens alone would
    not leave a text token."""
    if keep_last is None:
        return list(tokenizer(text, text_pair=text_pair, add_special_tokens=add_special_tokens)["input_ids"])
    specials = tokenizer.num_special_tokens_to_add(pair=text_pair is not None) if add_special_tokens else 0
    if keep_last <= specials + (text_pair is not None):
        return encode_text(tokenizer, text, text_pair, add_special_tokens)[-keep_last:]
    tokenizer.truncation_side = "left"  # (the tokenizer is this thread's own)
    return list(tokenizer(text, text_pair=text_pair, add_special_tokens=add_special_tokens, truncation=True,
                          max_length=keep_last)["input_ids"])


# tokenizer_config.json's `tokenizer_class` values that name transformers' generic tokenizers-backed class
# (what a converted GGUF's tokenizer is), which AutoTokenizer resolves without a model-specific class.
_GENERIC_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def _generic_backend(model_dir: Path) -> type | None:
    """transformers' generic tokenizer class where `model_dir`'s tokenizer is one, else None. Loaded through
    it, the tokenizer is AutoTokenizer's, and the start skips AutoTokenizer's import: transformers' scan of
    every model family's source files (docs/benchmarks.md, stop 93)."""
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except (OSError, ValueError, ImportError):  # no such file, or a transformers without that module
        return None
    generic = isinstance(config, dict) and config.get("tokenizer_class") in _GENERIC_CLASSES
    return TokenizersBackend if generic else None


class TokenizerCopies:
    """Copies of one tokenizer for the threads that each use one (a `tokenizers` object is not shared between
    threads: the grammar compiler's, the async engine's, the server's event loop's). A copy is a deep copy,
    Rust that holds the GIL throughout (docs/benchmarks.md, stop 94), so a start makes them ahead where its
    own thread would only wait for the device (`make`, during the warm-up's first run); `take` hands one out,
    or copies one then where none were made."""

    def __init__(self, tokenizer: Any, count: int) -> None:
        self.tokenizer = tokenizer
        self._wanted = count  # copies still to be handed out that `make` prepares
        self._made: list[Any] = []
        self._lock = threading.Lock()

    def make(self) -> None:
        """Prepares the copies still wanted, on the caller's thread."""
        while True:
            with self._lock:
                if self._wanted <= 0:
                    return
                self._wanted -= 1
            made = copy.deepcopy(self.tokenizer)
            with self._lock:
                self._made.append(made)

    def take(self) -> Any:
        """A copy of the tokenizer of the caller's own: a prepared one, or one copied now."""
        with self._lock:
            if self._made:
                return self._made.pop()
            self._wanted = max(self._wanted - 1, 0)
        return copy.deepcopy(self.tokenizer)


def is_fallback_template(tokenizer: Any) -> bool:
    """Whether `tokenizer`'s chat template is jaxserve's fallback: the model ships none."""
    return getattr(tokenizer, "chat_template", None) == FALLBACK_CHAT_TEMPLATE


def apply_chat_template(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    *,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    content_format: str = "auto",
) -> list[int]:
    """Renders a conversation and tokenizes it (the template supplies any special tokens), as the chat API
    renders a request's: each message's content as the template reads it (`content_format`, vLLM's
    --chat-template-content-format: OpenAI's text parts joined, or a text made one part), `tools` and
    `chat_template_kwargs` passed to the template, and `continue_final_message` leaving the last message
    open for the model to go on with."""
    if not messages:
        raise ValueError("messages must not be empty")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    content_format = resolve_content_format(content_format, chat_template or tokenizer.chat_template, tools)
    conversation = []
    for i, message in enumerate(messages):
        try:
            texts = content_texts(message.get("content"))
        except ValueError as e:
            raise ValueError(f"messages[{i}]: {e}") from None
        conversation.append(message if texts is None else {**message, "content": template_content(texts,
                                                                                                  content_format)})
    text = tokenizer.apply_chat_template(
        conversation, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message, tools=tools, tokenize=False, **(chat_template_kwargs or {}),
    )
    return tokenizer.encode(text, add_special_tokens=False)
