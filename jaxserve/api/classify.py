"""POST /classify (vLLM's): each input classified by a classifier model (an architecture ending in
ForSequenceClassification, served by `--runner pooling`): one engine request per input, batched by the
scheduler like any prompt, its pooled vector the classes' logits, returned through the model's activation
(`classifier.class_activation`; none with `use_activation: false`) with the likeliest class's label. A body
with `messages` instead of `input` is classified as one input, rendered by the chat template as vLLM's chat
form renders it."""

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.api.embeddings import check_classifier, check_pooling, pooled, prompt_inputs, read_pooling_request
from jaxserve.api.protocol import (
    ClassificationChatRequest,
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    UsageInfo,
    random_id,
)
from jaxserve.api.serving import get_serving
from jaxserve.engine.scoring import class_probabilities


async def create_classification(request: Request) -> Response:
    serving = get_serving(request)
    check_pooling(serving, "classifications")
    check_classifier(serving, True)
    req = await read_pooling_request(serving, request, ClassificationRequest, ClassificationChatRequest,
                                     "classifies")
    prompts = await prompt_inputs(serving, req)
    request_id = random_id("classify")
    labels = serving.info.class_labels
    activation = serving.info.class_activation if req.applies_activation() else "none"
    classified = []
    for i, logits in enumerate(await pooled(serving, request, prompts, req.priority, request_id)):
        probs = class_probabilities(logits, activation)
        classified.append(ClassificationData(index=i, label=labels[int(np.argmax(probs))], probs=probs.tolist(),
                                             num_classes=len(labels)))
    num_tokens = sum(map(len, prompts))
    return JSONResponse(ClassificationResponse(
        id=request_id, model=req.model or serving.model_names[0], data=classified,
        usage=UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens)).model_dump())
