"""OpenAI request/response schemas (pydantic), with vLLM's sampling extras.

Requests ignore unknown fields, as OpenAI's and vLLM's servers do; a field we know but do not support
(suffix, best_of > n) is rejected with a 400 that names it.
"""

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# OpenAI's reasoning efforts, as vLLM takes them
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]

# OpenAI's metadata (a response's, a chat completion's): at most 16 pairs, keys of at most 64 characters and
# values of at most 512.
Metadata = Annotated[
    dict[Annotated[str, StringConstraints(max_length=64)], Annotated[str, StringConstraints(max_length=512)]],
    Field(max_length=16),
]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # with include_usage: every chunk carries the usage so far


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced, strict or not


class ResponseFormat(BaseModel):
    """OpenAI's response_format: "text", "json_object" (any JSON object) or "json_schema"."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs`: exactly one of json, json_object, regex, choice, grammar."""

    model_config = ConfigDict(extra="ignore")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    whitespace_pattern: str | None = None


# Fields OpenAI's API lets a client send as null, meaning the default (completions' max_tokens: its 16)
NULL_IS_DEFAULT = frozenset({"n", "stream", "logprobs", "echo", "parallel_tool_calls", "max_tokens"})


class SamplingFields(BaseModel):
    """What completions and chat share: OpenAI's sampling fields and vLLM's extras."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(data.get(name, 0) is None for name in NULL_IS_DEFAULT):
            return {key: value for key, value in data.items() if value is not None or key not in NULL_IS_DEFAULT}
        return data

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None  # per prompt token: its logprob and this many alternatives
    cache_salt: str | None = None  # requests share cached prefixes only with requests of the same salt
    priority: int = Field(default=0, ge=-(2**63), le=2**63 - 1)  # under --scheduling-policy priority: lower first
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: max_model_len)
    bad_words: list[str] | None = None  # words the output never completes
    allowed_token_ids: list[int] | None = None  # the only tokens the output may hold (EOS only if listed)
    return_token_ids: bool = False  # the prompt's and each choice's token ids beside the text
    # logprobs name tokens "token_id:{id}", not by their text; None: the server's --return-tokens-as-token-ids
    return_tokens_as_token_ids: bool | None = None
    request_id: str | None = None  # the response's id is "{prefix}-{this}" (an X-Request-Id header wins)
    use_beam_search: bool = False  # vLLM's beam search (api/beam_search.py): n beams, whole results
    length_penalty: float = 1.0  # beam search ranks by cumulative logprob / length ** length_penalty
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs, and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True  # the tokenizer's own (a BOS) around a text prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... pass through to the template

    role: str
    content: str | list[dict[str, Any]] | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ChatTool] | None = Field(default=None, max_length=1024)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None  # for templates that render retrieved documents (RAG)
    add_special_tokens: bool = False  # the tokenizer's own on top of what the template writes (a second BOS)
    include_reasoning: bool = True  # under --reasoning-parser: false drops reasoning_content
    # OpenAI's: the chat template's `reasoning_effort` (GPT-OSS's template writes it into the system message)
    reasoning_effort: ReasoningEffort | None = None
    echo: bool = False  # the reply starts with the last message's content when it is the assistant's


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens read from the prefix cache rather than computed


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0) -> "UsageInfo":
        return cls(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                   total_tokens=num_prompt_tokens + num_completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached_tokens))


class PromptLogprob(BaseModel):
    """One entry of vLLM's `prompt_logprobs`: {token id: this} per prompt token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobList = list[dict[int, PromptLogprob] | None]


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobList | None = None
    token_ids: list[int] | None = None  # return_token_ids: the choice's (a stream chunk's: its new ones)
    prompt_token_ids: list[int] | None = None  # return_token_ids (a stream: in each choice's first chunk)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallInfo(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # --reasoning-parser: the <think> part
    reasoning: str | None = None  # the same, under vLLM's newer name (clients read one or the other)
    tool_calls: list[ToolCallInfo] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids: every token the choice generated


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobList | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: the rendered prompt's


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # the same, under vLLM's newer name
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids: the tokens since the choice's last chunk


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: in each choice's first chunk


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "jaxserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_path: str
    load_inplace: bool = False  # replace an adapter of the same name


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_int_id: int | None = None  # vLLM's; the name decides


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False  # each token's string beside its id (vLLM's)


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # as chat's: only with --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: ReasoningEffort | None = None  # as chat's
    tools: list[ChatTool] | None = Field(default=None, max_length=1024)  # given to the template, as chat's
    documents: list[dict[str, str]] | None = None
    add_special_tokens: bool = False
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # the tokenizer's own strings (byte-level BPE's, e.g. "Ġworld")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class _PooledInput(BaseModel):
    """A pooling request's prompts (embeddings, classifications): texts or token ids, each pooled."""

    input: str | list[str] | list[int] | list[list[int]]
    add_special_tokens: bool = True


class _PooledChat(BaseModel):
    """A pooling request's conversation, rendered by the chat template and pooled as one input (vLLM's
    defaults: no generation prompt, no special tokens beyond the template's)."""

    messages: list[ChatMessage]
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class _EmbeddingFields(BaseModel):
    """What both embeddings requests take: OpenAI's fields and vLLM's extras (truncate_prompt_tokens,
    normalize, priority)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # matryoshka models only: the embedding's first k values, normalized
    user: str | None = None
    # vLLM extras
    truncate_prompt_tokens: int | None = None
    normalize: bool = True  # to unit length (L2), as OpenAI's embeddings are
    priority: int = Field(default=0, ge=-(2**63), le=2**63 - 1)


class EmbeddingRequest(_EmbeddingFields, _PooledInput):
    """OpenAI's embeddings request: texts or token ids, each embedded."""


class EmbeddingChatRequest(_EmbeddingFields, _PooledChat):
    """vLLM's chat embeddings request: a conversation embedded as one input."""


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # a base64 text of little-endian float32 values for encoding_format base64


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


class _ActivationFields(BaseModel):
    """vLLM's switch for a classifier's activation (`use_activation`, and its former names `activation` and
    `softmax`): false gives the raw logits."""

    use_activation: bool | None = None
    activation: bool | None = None
    softmax: bool | None = None

    def applies_activation(self) -> bool:
        given = (self.use_activation, self.activation, self.softmax)
        return next((value for value in given if value is not None), True)


class _ClassificationFields(_ActivationFields):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    priority: int = Field(default=0, ge=-(2**63), le=2**63 - 1)


class ClassificationRequest(_ClassificationFields, _PooledInput):
    """vLLM's /classify: texts or token ids, each classified by a classifier model."""


class ClassificationChatRequest(_ClassificationFields, _PooledChat):
    """vLLM's chat form of /classify: a conversation classified as one input."""


class ClassificationData(BaseModel):
    index: int
    label: str  # the likeliest class's (the model's id2label)
    probs: list[float]  # each class's probability (the model's activation; the logits without one)
    num_classes: int


class ClassificationResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ClassificationData]
    usage: UsageInfo


class ScoreRequest(_ActivationFields):
    """vLLM's /v1/score: each text_1 against its text_2 (1:1, 1:N or N:N)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None
    priority: int = Field(default=0, ge=-(2**63), le=2**63 - 1)


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: UsageInfo


class RerankRequest(_ActivationFields):
    """vLLM's /v1/rerank (Jina's and Cohere's shape): the documents ranked by their relevance to the query."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    query: str
    documents: list[str]
    top_n: int = 0  # the best this many; 0: all
    truncate_prompt_tokens: int | None = None
    priority: int = Field(default=0, ge=-(2**63), le=2**63 - 1)


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int  # the document's place in the request
    document: RerankDocument
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


# The Responses API (/v1/responses), text subset: OpenAI's field names; items are checked by the handler.
class ResponsesTextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponsesText(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: ResponsesTextFormat | None = None


class ResponsesNamedToolChoice(BaseModel):
    type: Literal["function"]
    name: str


class ReasoningOptions(BaseModel):
    """The Responses API's `reasoning`: its `effort` (a summary is not written)."""

    model_config = ConfigDict(extra="ignore")

    effort: ReasoningEffort | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=1024)  # function tools, flat
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedToolChoice | None = None
    parallel_tool_calls: bool = True
    text: ResponsesText | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True
    metadata: Metadata | None = None
    user: str | None = None
    background: bool = False  # answered by the server on its own time; polled with GET, ended with cancel
    reasoning: ReasoningOptions | None = None  # its effort is chat's reasoning_effort
    # vLLM extras
    top_k: int | None = None
    seed: int | None = None
    priority: int = Field(default=0, ge=-(2**63), le=2**63 - 1)


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class MessageItem(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallItem(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ReasoningItem(BaseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = MessageItem | FunctionCallItem | ReasoningItem


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0  # openai-python's model requires it


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["completed", "incomplete", "in_progress", "failed", "queued", "cancelled"]
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    previous_response_id: str | None = None
    store: bool = True
    metadata: Metadata | None = None
    user: str | None = None
    usage: ResponseUsage | None = None
    error: ErrorInfo | None = None
    incomplete_details: IncompleteDetails | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["disabled"] = "disabled"
    background: bool = False


class ResponseQuery(BaseModel):
    """GET /v1/responses/{id}'s query: `stream` a background response created with stream=true again, its
    events after `starting_after` (a sequence number; -1: from the first)."""

    model_config = ConfigDict(extra="ignore")

    stream: bool = False
    starting_after: int = Field(default=-1, ge=-1, le=2**63 - 1)


class InputItemsQuery(BaseModel):
    """GET /v1/responses/{id}/input_items's query: OpenAI's cursor pages (`after`: the id of the item the
    page follows)."""

    model_config = ConfigDict(extra="ignore")

    order: Literal["asc", "desc"] = "desc"
    limit: int = Field(default=20, ge=1, le=100)
    after: str | None = None


class ResponseItemList(BaseModel):
    """A page of a response's input items (GET /v1/responses/{id}/input_items), OpenAI's cursor list."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True


class ResponseEvent(BaseModel):
    """One server-sent event of a streamed response: its `type` (response.created, ...) and its fields."""

    model_config = ConfigDict(extra="allow")

    type: str
    sequence_number: int
