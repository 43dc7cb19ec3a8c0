"""Structured outputs in the engine (tiny random Llama, the SmolLM2 tokenizer): every sampled token is
one the grammar allows (checked by a fresh llguidance matcher), constrained and free rows share steps,
the device mask equals llguidance's own, min_tokens meets a finished grammar, nothing compiles."""

import re

import jax.numpy as jnp
import llguidance
import numpy as np
import pytest
from llguidance.numpy import allocate_token_bitmask, apply_token_bitmask_inplace

from jaxserve.engine.step_io import bitmask_words
from jaxserve.engine.structured_output import allowed_tokens
from jaxserve.runner.sampler import apply_token_bitmask
from jaxserve.sampling_params import InvalidParam, SamplingParams
from jaxserve.sampling_params import StructuredOutputsParams as Structure
from tests.engine.helpers import make_prompts
from tests.helpers import count_compilations

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
        "score": {"type": "number"},
    },
    "required": ["id", "tags"],
    "additionalProperties": False,
}


def run(engine, requests: list[tuple[list[int], SamplingParams]]) -> list:
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"so-{i}", prompt, params)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.error is None, output.error
            if output.finished:
                finished[output.request_id] = output
    return [finished[f"so-{i}"] for i in range(len(requests))]


def accepted_by_grammar(engine, structure: Structure, token_ids: list[int]) -> bool:
    """A fresh matcher, independent of the engine's, accepts the whole output."""
    compiled = engine.grammars.compile(structure)
    matcher = compiled.matcher().llmatcher
    return matcher.validate_tokens(token_ids) == len(token_ids)


def test_mixed_batch_every_token_allowed(engine):
    json_structure = Structure(json=SCHEMA)
    regex_structure = Structure(regex=r"[a-c]{2,6}-\d{1,3}")
    choice_structure = Structure(choice=["alpha", "beta gamma", "δ"])
    prompts = make_prompts(8)
    structures = [json_structure, None, regex_structure, choice_structure, json_structure, None, regex_structure,
                  choice_structure]
    requests = []
    for i, (prompt, structure) in enumerate(zip(prompts, structures, strict=True)):
        temperature = 0.0 if i % 2 else 1.0
        requests.append((prompt, SamplingParams(temperature=temperature, seed=i, max_tokens=40, n=1 + (i == 4),
                                                structured_outputs=structure)))
    with count_compilations() as compiles:
        outputs = run(engine, requests)
    assert compiles == [], "a constrained request compiled something after warm-up"
    for output, structure in zip(outputs, structures, strict=True):
        for completion in output.outputs:
            if structure is None:
                continue
            assert accepted_by_grammar(engine, structure, completion.token_ids), completion.text
            if completion.finish_reason == "length":
                continue  # cut by max_tokens: a prefix of the language
            if structure is regex_structure:
                assert re.fullmatch(r"[a-c]{2,6}-\d{1,3}", completion.text), completion.text
            elif structure is choice_structure:
                assert completion.text in ("alpha", "beta gamma", "δ")
    assert len(outputs[4].outputs) == 2


def test_json_outputs_validate(engine):
    jsonschema = pytest.importorskip("jsonschema")
    import json

    structure = Structure(json=SCHEMA)
    requests = [(prompt, SamplingParams(temperature=0.7, seed=s, max_tokens=120, structured_outputs=structure))
                for s, prompt in enumerate(make_prompts(6))]
    for output in run(engine, requests):
        completion = output.outputs[0]
        if completion.finish_reason == "stop":  # the grammar ended it; "length" is a valid prefix
            jsonschema.validate(json.loads(completion.text), SCHEMA)


def test_min_tokens_and_a_finished_grammar(engine):
    """The grammar wins: a finished choice ends the request before min_tokens; an open grammar (one that
    could stop but need not) keeps going until min_tokens."""
    prompt = make_prompts(1)[0]
    (done,) = run(engine, [(prompt, SamplingParams(temperature=0, max_tokens=30, min_tokens=20,
                                                   structured_outputs=Structure(choice=["yes", "no"])))])
    assert done.outputs[0].text in ("yes", "no") and done.outputs[0].finish_reason == "stop"
    (open_ended,) = run(engine, [(prompt, SamplingParams(temperature=0, max_tokens=12, min_tokens=8,
                                                         structured_outputs=Structure(regex=r"[ab]+")))])
    completion = open_ended.outputs[0]
    assert len(completion.token_ids) >= 8 and re.fullmatch(r"[ab]+", completion.text)


def test_invalid_definitions_are_invalid_params(engine):
    for structure in [Structure(regex="(unclosed"), Structure(grammar="start: missing_rule"),
                      Structure(json="{not json"), Structure(json={"type": "no-such-type"})]:
        with pytest.raises(InvalidParam) as info:
            engine.add_request("bad", [1, 2, 3], SamplingParams(structured_outputs=structure))
        assert info.value.param == "structured_outputs"
    assert not engine.has_unfinished_requests()
    for structure in [Structure(regex=r"[^\s\S]"), Structure(grammar="root ::= root"),
                      Structure(grammar="start: start"), Structure(json={"$ref": "#"})]:  # no output matches
        with pytest.raises(InvalidParam, match="matches no output") as info:
            engine.add_request("dead", [1, 2, 3], SamplingParams(structured_outputs=structure))
        assert info.value.param == "structured_outputs"
    assert not engine.has_unfinished_requests()
    with pytest.raises(InvalidParam):
        Structure(json={"type": "object"}, regex="a")
    with pytest.raises(InvalidParam):
        Structure(choice=[])


def test_a_grammar_that_reaches_a_dead_end_fails_the_request_rather_than_stopping_it(engine):
    """A JSON schema whose required property refers to itself starts well (`{"a": `) and then no token can
    continue it: llguidance's mask then allows EOS alone and accepts it, which ended the output as if
    complete ("stop"). The request fails instead, saying so, and the others in its step are untouched."""
    looping = Structure(json={"type": "object", "required": ["a"], "properties": {"a": {"$ref": "#/properties/a"}}})
    prompts = make_prompts(2)
    engine.add_request("dead-end", prompts[0], SamplingParams(temperature=0, max_tokens=16,
                                                              structured_outputs=looping))
    engine.add_request("beside", prompts[1], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished or output.error is not None:
                finished[output.request_id] = output
    failed, beside = finished["dead-end"], finished["beside"]
    assert failed.error is not None and "no token can continue the output" in failed.error
    assert beside.error is None and len(beside.outputs[0].token_ids) == 6


def test_compiled_grammars_are_cached(engine):
    first = engine.grammars.compile(Structure(json={"type": "object", "properties": {"a": {"type": "string"}}}))
    same = engine.grammars.compile(Structure(json={"properties": {"a": {"type": "string"}}, "type": "object"}))
    assert same is first  # equal definitions, whatever their key order
    assert first.matcher().llmatcher is not first.matcher().llmatcher  # each sequence its own matcher


def test_no_row_is_left_without_a_token(engine):
    """min_tokens' ban on every token the grammar allows would leave a row nothing: the row falls back to
    its grammar alone rather than sampling from all -inf."""
    import dataclasses

    from jaxserve.runner.buckets import Bucket
    from jaxserve.runner.packing import neutral_batch
    from jaxserve.runner.penalties import PenaltyTables
    from jaxserve.runner.sampler import sample

    vocab = engine.vocab_size
    neutral = neutral_batch(Bucket(8, 2, False), engine.runner.layout).sampling
    bitmask = np.zeros_like(neutral.token_bitmask)
    bitmask[:, 0] = 1 << 5  # only token 5 is allowed, in both rows
    bias_ids = np.full_like(neutral.bias_token_ids, vocab)
    bias_values = np.zeros_like(neutral.bias_values)
    bias_ids[0, 0], bias_values[0, 0] = 5, -np.inf  # row 0 bans it (min_tokens); row 1 biases another token
    bias_ids[1, 0], bias_values[1, 0] = 7, 100.0
    params = dataclasses.replace(neutral, token_bitmask=bitmask, constrained=np.array([True, True]),
                                 bias_token_ids=bias_ids, bias_values=bias_values)
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(2, vocab)).astype(np.float32))
    out = sample(logits, params, PenaltyTables.zeros(2, vocab), 2)
    assert out.tokens.tolist() == [5, 5]


def test_device_mask_equals_llguidance(engine):
    vocab = engine.vocab_size
    compiled = engine.grammars.compile(Structure(json=SCHEMA))
    matchers = [compiled.matcher() for _ in range(3)]
    assert matchers[1].consume(engine.tokenizer.encode('{"', add_special_tokens=False)[0])
    bitmask = allocate_token_bitmask(4, vocab)  # row 3 stays all-allowed and unconstrained
    for row, matcher in enumerate(matchers):
        llguidance.numpy.fill_next_token_bitmask(matcher.llmatcher, bitmask, row)
    logits = np.random.default_rng(0).normal(size=(4, vocab)).astype(np.float32)
    expected = logits.copy()
    apply_token_bitmask_inplace(expected[:3], bitmask[:3])
    constrained = np.array([True, True, True, False])
    got = np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(bitmask), jnp.asarray(constrained)))
    np.testing.assert_array_equal(got, expected)
    assert bitmask.shape[1] == bitmask_words(vocab)
    assert len(allowed_tokens(bitmask[0], vocab)) == np.isfinite(expected[0]).sum()


def test_a_grammar_waiting_for_the_end_of_reasoning_lets_tokens_pass_until_it_comes(engine):
    """`after_token_ids` (a reasoning model's `</think>`): tokens pass freely until the marker has been
    produced, then the grammar applies. A token forced by logit_bias that the grammar forbids shows where."""
    prompt = make_prompts(1)[0]

    def params(after: tuple[int, ...]) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=12, logit_bias={500: 60.0},
                              structured_outputs=Structure(regex=r"[0-9]{3}", after_token_ids=after))

    waiting, immediate = run(engine, [(prompt, params((500,))), (prompt, params(()))])
    assert re.fullmatch(r"[0-9]{3}", immediate.outputs[0].text), "without the wait the grammar rules from the start"
    token_ids = waiting.outputs[0].token_ids
    assert token_ids[0] == 500, "before the marker: the biased token, unconstrained"
    assert re.fullmatch(r"[0-9]{3}", engine.tokenizer.decode(token_ids[1:])), "after it: the grammar, bias or not"
    assert accepted_by_grammar(engine, Structure(regex=r"[0-9]{3}"), token_ids[1:])
    assert waiting.outputs[0].finish_reason == "stop"
    assert Structure(regex="a", after_token_ids=(500,)).key == Structure(regex="a").key, "one compiled grammar"


def test_a_waiting_matcher_opens_only_on_the_whole_marker_in_order(engine):
    compiled = engine.grammars.compile(Structure(regex=r"[0-9]+"))
    digit = engine.tokenizer.encode("7", add_special_tokens=False)[0]
    matcher = compiled.matcher(after_token_ids=(500, 501))
    for token in (501, 500, 7, 500):  # not the marker: anything passes, the grammar waits
        assert matcher.consume(token) and not matcher.is_active and not matcher.is_stopped
    assert matcher.consume(501) and matcher.is_active, "500 then 501: the grammar applies from here"
    assert not matcher.consume(500), "now the grammar rules"
    fresh = compiled.matcher(after_token_ids=(500, 501))
    assert fresh.consume(500) and fresh.consume(501) and fresh.consume(digit) and fresh.is_active
