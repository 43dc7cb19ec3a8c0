"""The one validation rule: SamplingParams ranges and RequestLimits (pure Python, milliseconds)."""

import math

import numpy as np
import pytest

from jaxserve.sampling_params import InvalidParam, RequestLimits, SamplingParams

LIMITS = RequestLimits(vocab_size=1000, max_model_len=8192, max_logprobs=20, max_biased_tokens=128,
                       num_eos_tokens=1, kv_capacity_tokens=100_000)


@pytest.mark.parametrize(
    "field,value",
    [
        ("top_k", 2**31),  # overflowed the i32 row of the step and killed the engine
        ("top_k", -2),
        ("top_k", 1.5),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", 1e308),
        ("temperature", 2.01),
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", math.nan),
        ("min_p", 1.1),
        ("repetition_penalty", 1e-300),  # underflows to 0 in float32
        ("repetition_penalty", 0.0),
        ("repetition_penalty", math.inf),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -math.inf),
        ("n", 0),
        ("n", 129),
        ("n", True),
        ("max_tokens", 0),
        ("max_tokens", 2**31),
        ("min_tokens", -1),
        ("logprobs", -1),
        ("seed", 2**64),
        ("stop", [""]),
        ("stop", ["x"] * 65),
        ("stop_token_ids", [-1]),
        ("logit_bias", {5: math.nan}),
        ("logit_bias", {5: 101.0}),
        ("logit_bias", {-1: 1.0}),
        ("detokenize", "no"),  # a truthy string was taken as True
        ("ignore_eos", None),
        ("skip_special_tokens", 0),
        ("include_stop_str_in_output", "false"),
        ("spaces_between_special_tokens", []),
    ],
)
def test_out_of_range_fields_are_rejected_by_name(field, value):
    with pytest.raises(InvalidParam) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field
    assert field in str(info.value)


def test_limits_of_the_device_arrays_are_accepted_and_fit_them():
    params = SamplingParams(top_k=2**31 - 1, temperature=2.0, n=128, repetition_penalty=0.01, seed=2**64 - 1,
                            top_p=1e-9, logit_bias={999: -100.0})
    np.int32(params.top_k)  # what build_step_batch stores
    assert np.float32(params.repetition_penalty) > 0
    assert SamplingParams(top_k=-1).top_k == 0  # vLLM's "off"


def test_engine_limits():
    with pytest.raises(InvalidParam, match="empty"):
        LIMITS.check([], SamplingParams())
    with pytest.raises(InvalidParam, match="vocabulary") as info:
        LIMITS.check([1000], SamplingParams())
    assert info.value.param == "prompt"
    with pytest.raises(InvalidParam, match="at most 20") as info:
        LIMITS.check([1], SamplingParams(logprobs=21))
    assert info.value.param == "logprobs"
    with pytest.raises(InvalidParam, match="stop_token_ids") as info:
        LIMITS.check([1], SamplingParams(stop_token_ids=[1000]))
    assert info.value.param == "stop_token_ids"
    with pytest.raises(InvalidParam, match="at most 128") as info:
        LIMITS.check([1], SamplingParams(logit_bias={i: 1.0 for i in range(128)}))
    assert info.value.param == "logit_bias"
    LIMITS.check([1], SamplingParams(logit_bias={i: 1.0 for i in range(127)}))
    with pytest.raises(InvalidParam, match="at most 128") as info:  # named by the field that names the most
        LIMITS.check([1], SamplingParams(logit_bias={1: 1.0}, stop_token_ids=list(range(200))))
    assert info.value.param == "stop_token_ids"


def test_context_length_errors_name_real_numbers():
    with pytest.raises(InvalidParam) as info:
        LIMITS.check([1] * 9031, SamplingParams(max_tokens=None))
    message = str(info.value)
    assert "maximum context length is 8192 tokens" in message and "9031 tokens" in message
    assert "-" not in message.replace("context length", "")  # no negative completion size
    with pytest.raises(InvalidParam, match=r"requested 8200 tokens \(100 in the prompt, 8100 for the completion\)"):
        LIMITS.check([1] * 100, SamplingParams(max_tokens=8100))
    LIMITS.check([1] * 8191, SamplingParams(max_tokens=None))
    small_cache = RequestLimits(1000, 8192, 20, 128, 1, kv_capacity_tokens=512)
    with pytest.raises(InvalidParam, match="KV cache"):
        small_cache.check([1] * 10, SamplingParams(max_tokens=600))


def test_output_kind_must_be_a_request_output_kind():
    from jaxserve.outputs import RequestOutputKind

    assert SamplingParams(output_kind=RequestOutputKind.DELTA).output_kind is RequestOutputKind.DELTA
    for bad in ("delta", 1, None, 10**30):
        with pytest.raises(InvalidParam, match="output_kind") as info:
            SamplingParams(output_kind=bad)
        assert info.value.param == "output_kind"


def test_min_tokens_past_what_the_context_leaves_is_refused_without_max_tokens():
    """Without max_tokens a request may run to the context's end: min_tokens beyond that (EOS banned until the
    context is full) is refused, as vLLM refuses min_tokens > the max_tokens it fills in."""
    LIMITS.check([1] * 100, SamplingParams(max_tokens=None, min_tokens=8092))
    with pytest.raises(InvalidParam, match=r"min_tokens \(8093\) must be <= max_tokens \(the 8092 tokens") as info:
        LIMITS.check([1] * 100, SamplingParams(max_tokens=None, min_tokens=8093))
    assert info.value.param == "min_tokens"
