"""What the engine hands back for each request (pure Python, no jax)."""

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One of a request's `n` completions. Text and token ids are cumulative; `*_delta` is what the
    latest step added (what a stream sends)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None  # per token, when the request asked for logprobs
    top_logprobs: list[dict[int, float]] | None = None  # per token, when it asked for logprobs > 0
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)
