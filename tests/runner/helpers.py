"""Runner test helpers: a request taking its row, and a bitwise comparison of two pytrees."""

import jax
import numpy as np

from jaxserve.engine.step_io import NewRequest
from jaxserve.sampling_params import SamplingParams


def new_request(request_id: str, seed: int = 0, num_prompt_tokens: int = 1,
                cached_token_ids: tuple[int, ...] | None = None, **params) -> NewRequest:
    return NewRequest.of(request_id, SamplingParams(**params), seed, num_prompt_tokens, cached_token_ids)


def leaves_equal(a, b) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()
