"""POST /classify (vLLM's): each input classified by a classifier model (an architecture ending in
ForSequenceClassification, served by `--runner pooling`): one engine request per input, batched by the
scheduler like any prompt, its pooled vector the classes' logits, returned as probabilities with the
likeliest class's label."""

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.api.embeddings import check_classifier, check_pooling, pooled, prompt_inputs
from jaxserve.api.protocol import (
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
    req = await serving.parse(request, ClassificationRequest)
    serving.check_model(req.model)
    prompts = await prompt_inputs(serving, req)
    request_id = random_id("classify")
    labels = serving.info.class_labels
    data = []
    for i, logits in enumerate(await pooled(serving, request, prompts, req.priority, request_id)):
        probs = class_probabilities(logits)
        data.append(ClassificationData(index=i, label=labels[int(np.argmax(probs))], probs=probs.tolist(),
                                       num_classes=len(labels)))
    return JSONResponse(ClassificationResponse(
        id=request_id, model=req.model or serving.model_names[0], data=data,
        usage=UsageInfo.of(sum(map(len, prompts)), 0)).model_dump())
