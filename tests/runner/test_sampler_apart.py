"""The plain step's sampler as a program of its own on CPUs (`step_fn.make_sample_fn`): compiled once per
request bucket at warm-up, nothing compiled after it, and the tokens and logprobs of the sampler inside the
step (what GPUs run)."""

import jax
import numpy as np
import pytest

from jaxserve.runner import model_runner
from jaxserve.runner.aot import abstract_step_args
from jaxserve.runner.model_runner import PLAIN
from jaxserve.sampling_params import SamplingParams
from tests.engine.helpers import make_engine, make_prompts
from tests.helpers import count_compilations

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the sampler is a program apart on CPUs only")

# Each of the sampler's stages: temperature, top-k, top-p, min-p, penalties, logprobs and their alternatives.
SETTINGS = [
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=5, max_tokens=8, ignore_eos=True, logprobs=3),
    SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2, repetition_penalty=1.3),
    SamplingParams(temperature=1.0, min_p=0.1, frequency_penalty=0.5, presence_penalty=0.2, seed=9, max_tokens=8,
                   ignore_eos=True),
]


def _serve(engine) -> dict[str, tuple[list[int], list[float], list[dict[int, float]]]]:
    """Six requests joining a step apart, so that steps run in buckets of several sizes: per request, its
    tokens, their logprobs (none where it did not ask) and the top alternatives."""
    prompts = make_prompts(6)
    results, step = {}, 0
    while step < 6 or engine.has_unfinished_requests():
        if step < 6:
            engine.add_request(str(step), prompts[step], SETTINGS[step % len(SETTINGS)])
        for output in engine.step():
            if output.finished:
                completion = output.outputs[0]
                results[output.request_id] = (completion.token_ids, completion.token_logprobs or [],
                                              completion.top_logprobs or [])
        step += 1
    return results


def _sampler_primitives(fn, *args) -> bool:
    """Whether the traced program draws random numbers (what only the full sampler does)."""
    return "random_bits" in str(jax.make_jaxpr(fn)(*args))


def test_the_cpu_step_leaves_its_sampler_to_one_program_per_request_bucket(engine):
    runner = engine.runner
    assert runner.sample_apart
    request_buckets = {bucket.num_reqs for bucket in runner.ladder.all_buckets()}
    assert set(runner._compiled_samplers) == request_buckets, "warm-up compiled a sampler for each R, and no more"
    bucket = max(runner.ladder.all_buckets())
    step_args = abstract_step_args(runner.model.state, runner._step_shapes, bucket, jax.devices()[0])
    assert not _sampler_primitives(runner._step_fns[PLAIN], *step_args), "the step draws nothing itself"
    with count_compilations() as compiles:
        results = _serve(engine)
    assert compiles == [], "every step and sampler was compiled at warm-up"
    assert all(len(tokens) == 8 for tokens, _, _ in results.values())


def test_the_sampler_apart_gives_the_tokens_and_logprobs_of_the_sampler_inside_the_step(llama_dir, engine,
                                                                                         monkeypatch):
    apart = _serve(engine)
    monkeypatch.setattr(model_runner, "samples_apart", lambda platform: False)
    inside = make_engine(llama_dir, warmup=False)
    assert not inside.runner.sample_apart
    bucket = max(inside.runner.ladder.all_buckets())
    step_args = abstract_step_args(inside.runner.model.state, inside.runner._step_shapes, bucket, jax.devices()[0])
    assert _sampler_primitives(inside.runner._step_fns[PLAIN], *step_args)
    assert inside.runner._compiled_samplers == {}
    together = _serve(inside)
    assert apart.keys() == together.keys()
    for request_id, (tokens, logprobs, top) in together.items():
        tokens_apart, logprobs_apart, top_apart = apart[request_id]
        assert tokens_apart == tokens, request_id
        np.testing.assert_allclose(logprobs_apart, logprobs, rtol=0, atol=1e-5)
        assert [list(step) for step in top_apart] == [list(step) for step in top], request_id
        np.testing.assert_allclose([list(step.values()) for step in top_apart], [list(step.values()) for step in top],
                                   rtol=0, atol=1e-5)
    assert sum(len(logprobs) for _, logprobs, _ in together.values()) == 4 * 8, "two settings of three ask"
