"""POST /v1/score and /v1/rerank (vLLM's, on a `--runner pooling` server): texts scored by the cosine
similarity of their embeddings, as vLLM scores them with a bi-encoder; or, by a classifier with one class (a
cross-encoder reranker), each pair read as one prompt, the tokenizer's pair encoding, its score the sigmoid
of the class logit.

/score pairs `text_1` with `text_2` one to one, or one `text_1` with every `text_2`; /rerank scores each
document against the query and returns them best first (the best `top_n`). Every text is embedded once,
as its own engine request, so the scheduler batches them as it batches /v1/embeddings' inputs.
"""

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.api.embeddings import MAX_INPUTS, check_pooled_prompt, check_pooling, pooled
from jaxserve.api.errors import APIError
from jaxserve.api.protocol import (
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    UsageInfo,
    random_id,
)
from jaxserve.api.serving import ModelServing, get_serving
from jaxserve.engine.scoring import check_pairing, class_probabilities, cosine_scores

SCORE_PATHS = ("/v1/score", "/score")
RERANK_PATHS = ("/v1/rerank", "/rerank", "/v2/rerank")


async def _tokenized(serving: ModelServing, texts: list[str], truncate: int | None, param: str) -> list[list[int]]:
    """Each text's token ids, checked against the engine's limits; a 400 names the text (`param.i` in a list)."""
    serving.check_truncation(truncate)
    result = []
    for i, text in enumerate(texts):
        name = f"{param}.{i}" if len(texts) > 1 else param
        if not text:
            raise APIError(400, "texts to score must not be empty", name)
        if truncate is None:
            serving.check_text_length(text, name)
        ids = await serving.encode(text, True, truncate)
        check_pooled_prompt(serving, ids, name)
        result.append(ids)
    return result


async def _cosine_scores(serving: ModelServing, request: Request, firsts: list[list[int]], seconds: list[list[int]],
                         priority: int, request_id: str) -> list[float]:
    """cos(first_i, second_i) for each pair, one first broadcast against every second."""
    vectors = await pooled(serving, request, firsts + seconds, priority, request_id)
    return cosine_scores(vectors[: len(firsts)], vectors[len(firsts):])


def _cross_encoding(serving: ModelServing) -> bool:
    """Whether the model scores pairs as a cross-encoder (a classifier with one class); a 400 for a
    classifier of several classes, which has no one score for a pair."""
    classes = len(serving.info.class_labels)
    if classes > 1:
        raise APIError(400, f"this model is a classifier of {classes} classes: scoring pairs needs a cross-encoder "
                            "(one class) or an embedding model; use /classify", "model")
    return classes == 1


async def _cross_scores(serving: ModelServing, request: Request, firsts: list[str], seconds: list[str],
                        truncate: int | None, priority: int, request_id: str, params: tuple[str, str],
                        use_activation: bool) -> tuple[list[float], int]:
    """A cross-encoder's score for each pair, one first broadcast against every second (the pair's class logit
    through the model's activation, a sigmoid unless its config says otherwise; the logit itself without
    `use_activation`), and the prompts' tokens. A pair over the context is a 400 naming its longer text."""
    serving.check_truncation(truncate)
    pairs = [(firsts[0], second) for second in seconds] if len(firsts) == 1 else list(zip(firsts, seconds, strict=True))
    prompts = []
    for i, (first, second) in enumerate(pairs):
        names = tuple(f"{param}.{i}" if len(texts) > 1 else param
                      for param, texts in zip(params, (firsts, seconds), strict=True))
        for name, text in zip(names, (first, second), strict=True):
            if not text:
                raise APIError(400, "texts to score must not be empty", name)
            if truncate is None:
                serving.check_text_length(text, name)
        ids = await serving.encode_pair(first, second, truncate)
        check_pooled_prompt(serving, ids, names[0] if len(first) > len(second) else names[1])
        prompts.append(ids)
    logits = await pooled(serving, request, prompts, priority, request_id)
    activation = serving.info.score_activation if use_activation else "none"
    return ([float(class_probabilities(pair_logits, activation)[0]) for pair_logits in logits],
            sum(map(len, prompts)))


async def create_score(request: Request) -> Response:
    serving = get_serving(request)
    check_pooling(serving, "scores")
    req = await serving.parse(request, ScoreRequest)
    serving.check_model(req.model)
    texts_1 = [req.text_1] if isinstance(req.text_1, str) else req.text_1
    texts_2 = [req.text_2] if isinstance(req.text_2, str) else req.text_2
    for param, texts in (("text_1", texts_1), ("text_2", texts_2)):
        if not texts:
            raise APIError(400, f"{param} must not be empty", param)
    try:
        check_pairing(len(texts_1), len(texts_2))
    except ValueError as error:
        raise APIError(400, f"text_1 and text_2: {error}", "text_1") from None
    if len(texts_1) + len(texts_2) > MAX_INPUTS:
        raise APIError(400, f"at most {MAX_INPUTS} texts per request", "text_2")
    request_id = random_id("score")
    if _cross_encoding(serving):
        scores, num_tokens = await _cross_scores(serving, request, texts_1, texts_2, req.truncate_prompt_tokens,
                                                 req.priority, request_id, ("text_1", "text_2"),
                                                 req.applies_activation())
    else:
        firsts = await _tokenized(serving, texts_1, req.truncate_prompt_tokens, "text_1")
        seconds = await _tokenized(serving, texts_2, req.truncate_prompt_tokens, "text_2")
        scores = await _cosine_scores(serving, request, firsts, seconds, req.priority, request_id)
        num_tokens = sum(map(len, firsts + seconds))
    return JSONResponse(ScoreResponse(
        id=request_id, model=req.model or serving.model_names[0],
        data=[ScoreData(index=i, score=score) for i, score in enumerate(scores)],
        usage=UsageInfo.of(num_tokens, 0)).model_dump())


async def create_rerank(request: Request) -> Response:
    serving = get_serving(request)
    check_pooling(serving, "scores")
    req = await serving.parse(request, RerankRequest)
    serving.check_model(req.model)
    if not req.documents:
        raise APIError(400, "documents must not be empty", "documents")
    if len(req.documents) + 1 > MAX_INPUTS:
        raise APIError(400, f"at most {MAX_INPUTS - 1} documents per request", "documents")
    if req.top_n < 0:
        raise APIError(400, f"top_n must be >= 0 (0: all the documents), got {req.top_n}", "top_n")
    request_id = random_id("rerank")
    if _cross_encoding(serving):
        scores, num_tokens = await _cross_scores(serving, request, [req.query], req.documents,
                                                 req.truncate_prompt_tokens, req.priority, request_id,
                                                 ("query", "documents"), req.applies_activation())
    else:
        query = await _tokenized(serving, [req.query], req.truncate_prompt_tokens, "query")
        documents = await _tokenized(serving, req.documents, req.truncate_prompt_tokens, "documents")
        scores = await _cosine_scores(serving, request, query, documents, req.priority, request_id)
        num_tokens = sum(map(len, query + documents))
    ranked = sorted(range(len(scores)), key=lambda i: -scores[i])[: req.top_n or None]
    return JSONResponse(RerankResponse(
        id=request_id, model=req.model or serving.model_names[0],
        usage=RerankUsage(total_tokens=num_tokens),
        results=[RerankResult(index=i, document=RerankDocument(text=req.documents[i]), relevance_score=scores[i])
                 for i in ranked]).model_dump())
