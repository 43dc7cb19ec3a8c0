"""Output kinds (`RequestOutputKind`): deltas add up to the cumulative outputs, and a final-only request
gets one output, the cumulative one (pure Python: the frontend's OutputProcessor, no model)."""

import dataclasses
import itertools

from jaxserve.engine.core_io import CoreOutputs, FirstToken, SequenceDetails
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.request import RequestStatus
from jaxserve.outputs import Logprob, RequestOutput, RequestOutputKind, add_delta
from jaxserve.sampling_params import SamplingParams

PROMPT = [504, 3458, 314, 260, 2767, 28]


def update(seq_id: str, token_id: int, logprob: float, top: dict | None = None,
           status: RequestStatus | None = None, time: float = 0.0, first: FirstToken | None = None) -> CoreOutputs:
    """One sequence's token as a step's outputs, with its details."""
    return CoreOutputs([seq_id], [token_id], [logprob], time, {0: SequenceDetails(top, status, None, 0, first)}, [])


def run(tokenizer, kind: RequestOutputKind) -> list[RequestOutput]:
    """Two completions of one request, fed the same updates: the first stops on a stop string, the second
    on its length a step before; logprobs with alternatives and prompt logprobs throughout."""
    params = SamplingParams(n=2, logprobs=1, prompt_logprobs=0, stop=" cat", max_tokens=6, output_kind=kind)
    text = tokenizer.encode(" the big dog and the cat sat down", add_special_tokens=False)
    processor = OutputProcessor()
    processor.add("r", None, PROMPT, params, ["r#0", "r#1"],
                  [IncrementalDetokenizer.for_prompt(tokenizer, PROMPT, params) for _ in range(2)], 0.0)
    prompt_logprobs = [{t: Logprob(-1.0, 1)} for t in PROMPT[1:]]
    outputs = []
    for step in range(7):
        updates = []
        for seq in (0, 1):
            token = text[step]
            first = FirstToken(0.5, 0, prompt_logprobs if seq == 0 else None) if step == 0 else None
            status = RequestStatus.FINISHED_LENGTH if seq == 1 and step == 4 else None
            if step < 5 or seq == 0:
                updates.append(update(f"r#{seq}", token, -0.1 * step, {token: -0.1 * step}, status,
                                      time=1.0 + step, first=first))
        processed = processor.process(updates)
        assert set(processed.stopped) <= {"r#0"}
        outputs += processed.outputs
    return outputs


def as_final(output: RequestOutput) -> tuple:
    """Everything a final output says, without the per-step deltas."""
    completions = [dataclasses.replace(c, text_delta="", token_ids_delta=[]) for c in output.outputs]
    return (completions, output.finished, output.prompt_logprobs, output.num_cached_tokens, output.metrics)


def test_deltas_add_up_to_the_cumulative_outputs(smollm2_tokenizer):
    cumulative = run(smollm2_tokenizer, RequestOutputKind.CUMULATIVE)
    deltas = run(smollm2_tokenizer, RequestOutputKind.DELTA)
    assert len(deltas) == len(cumulative) and cumulative[-1].finished
    assert cumulative[-1].outputs[0].stop_reason == " cat" and cumulative[-1].outputs[1].finish_reason == "length"
    first_delta = [c.token_ids[:] for c in deltas[0].outputs]
    total = None
    for delta, whole in zip(deltas, cumulative, strict=True):
        for d, c in zip(delta.outputs, whole.outputs, strict=True):
            assert d.token_ids == c.token_ids_delta and d.text == d.text_delta == c.text_delta
            assert len(d.token_logprobs) == len(d.top_logprobs) == len(d.token_ids)
        total = add_delta(total, delta)
        so_far = [(c.token_ids, c.token_logprobs, c.top_logprobs, c.finish_reason) for c in total.outputs]
        assert so_far == [(c.token_ids, c.token_logprobs, c.top_logprobs, c.finish_reason) for c in whole.outputs]
        # The text so far is what was streamed: a cumulative output also holds what may start a stop string.
        assert all(whole_c.text.startswith(c.text) for c, whole_c in zip(total.outputs, whole.outputs, strict=True))
    assert as_final(total) == as_final(cumulative[-1])
    assert [c.token_ids for c in deltas[0].outputs] == first_delta, "a delta is never changed after it is sent"
    assert [d.prompt_logprobs is not None for d in deltas].count(True) == 1, "prompt logprobs are sent once"
    assert deltas[0].prompt_logprobs == cumulative[0].prompt_logprobs


def test_a_final_only_request_gets_one_output_the_cumulative_one(smollm2_tokenizer):
    cumulative = run(smollm2_tokenizer, RequestOutputKind.CUMULATIVE)
    (final,) = run(smollm2_tokenizer, RequestOutputKind.FINAL_ONLY)
    assert as_final(final) == as_final(cumulative[-1])


def test_plain_tokens_without_details_give_the_outputs_they_would_with_them(smollm2_tokenizer):
    """The core sends a step's plain tokens as bare columns; the frontend makes of them what it makes of
    tokens with (empty) details, one record each, a stop string found among them included."""
    text = smollm2_tokenizer.encode(" one two three four five", add_special_tokens=False)
    params = SamplingParams(n=2, logprobs=0, stop=" four", max_tokens=len(text))

    def run_steps(as_columns: bool) -> list:
        processor = OutputProcessor()
        processor.add("r", None, PROMPT, params, ["r#0", "r#1"],
                      [IncrementalDetokenizer.for_prompt(smollm2_tokenizer, PROMPT, params) for _ in range(2)], 0.0)
        steps = []
        for step, token in enumerate(text):
            plain = [(f"r#{seq}", token + seq, -0.5 * step) for seq in (0, 1)]
            if step == 0 or not as_columns:
                first = FirstToken(0.5, 0, None) if step == 0 else None
                updates = [update(seq_id, token_id, logprob, time=2.0 + step, first=first)
                           for seq_id, token_id, logprob in plain]
            else:
                updates = [CoreOutputs(*map(list, zip(*plain, strict=True)), 2.0 + step, {}, [])]
            processed = processor.process(updates)
            steps.append((processed.outputs, processed.stopped, processed.dropped))
        return steps

    records, columns = run_steps(False), run_steps(True)
    assert columns == records
    assert any(stopped == ["r#0"] for _, stopped, _ in columns), "the stop string ended the first sequence"


def test_a_sibling_ahead_of_the_first_sequence_waits_for_the_prompt_logprobs(smollm2_tokenizer):
    """Prompt logprobs come with the first sequence's first token; a request's outputs wait for them, so
    the first output of a DELTA request (sent once) and every cumulative one carry them."""
    entries = [{t: Logprob(-1.0, 1)} for t in PROMPT[1:]]
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
        params = SamplingParams(n=2, prompt_logprobs=0, max_tokens=4, output_kind=kind)
        processor = OutputProcessor()
        processor.add("r", None, PROMPT, params, ["r#0", "r#1"],
                      [IncrementalDetokenizer.for_prompt(smollm2_tokenizer, PROMPT, params) for _ in range(2)], 0.0)
        early = processor.process([update("r#1", 504, -0.5, time=1.0, first=FirstToken(0.5, 0, None))])
        assert early.outputs == [], "no output before the prompt logprobs are known"
        (output,) = processor.process([update("r#0", 3458, -0.5, time=2.0, first=FirstToken(0.5, 0, entries)),
                                       update("r#1", 314, -0.5, time=2.0)]).outputs
        assert output.prompt_logprobs == [None, *entries]
        assert [c.token_ids for c in output.outputs] == [[3458], [504, 314]], "the sibling's tokens were kept"


def _feed(tokenizer, params: SamplingParams, text: str, last: SequenceDetails | None = None) -> list:
    """`text`'s tokens fed to a one-sequence request, the last with `last`'s details: its outputs, until it
    stops."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    processor = OutputProcessor()
    processor.add("r", None, PROMPT, params, ["r#0"], [IncrementalDetokenizer.for_prompt(tokenizer, PROMPT, params)],
                  0.0)
    outputs = []
    for i, token in enumerate(ids):
        details = {0: last} if last is not None and i == len(ids) - 1 else {}
        processed = processor.process([CoreOutputs(["r#0"], [token], [0.0], 1.0 + i, details, [])])
        outputs += [o.outputs[0] for o in processed.outputs]
        if processed.stopped or (outputs and outputs[-1].finish_reason):
            break
    return outputs


def test_stop_strings_count_from_the_token_after_min_tokens(smollm2_tokenizer):
    """vLLM's rule: a stop string ends a sequence only once more than min_tokens tokens are out, and only
    one that ends in the text from there on."""
    text = " stop a b c d stop e"
    delta = RequestOutputKind.DELTA
    early = _feed(smollm2_tokenizer, SamplingParams(stop=" stop", max_tokens=20, output_kind=delta), " a stop b")
    assert "".join(o.text for o in early) == " a" and early[-1].stop_reason == " stop"
    outputs = _feed(smollm2_tokenizer, SamplingParams(stop=" stop", min_tokens=3, max_tokens=20, output_kind=delta),
                    text)
    assert "".join(o.text for o in outputs) == " stop a b c d" and outputs[-1].finish_reason == "stop"


def test_the_stop_token_s_text_is_left_out_unless_stop_strings_are_included(smollm2_tokenizer):
    """The EOS or stop id the core ended a sequence on is in its token ids, not its text (vLLM's), unless
    include_stop_str_in_output."""
    newline = smollm2_tokenizer.encode("\n", add_special_tokens=False)[-1]
    ended = SequenceDetails(None, RequestStatus.FINISHED_STOPPED, newline, 0, None, None, True)
    for include, expected in [(False, " one two"), (True, " one two\n")]:
        params = SamplingParams(stop_token_ids=[newline], max_tokens=20, include_stop_str_in_output=include,
                                output_kind=RequestOutputKind.CUMULATIVE)
        *_, last = _feed(smollm2_tokenizer, params, " one two\n", ended)
        assert (last.text, last.finish_reason, last.stop_reason) == (expected, "stop", newline)
        assert last.token_ids[-1] == newline
    completed = SequenceDetails(None, RequestStatus.FINISHED_STOPPED, None, 0, None, None, False)  # a grammar's end
    params = SamplingParams(max_tokens=20, output_kind=RequestOutputKind.CUMULATIVE)
    assert _feed(smollm2_tokenizer, params, ' {"a": 1}', completed)[-1].text == ' {"a": 1}'


def test_a_stop_string_completed_by_the_last_allowed_token_is_a_stop(smollm2_tokenizer):
    """The core ends a sequence on max_tokens with the token that completes a stop string: the text is cut
    at the string, and the finish is a stop with that string as its reason, as vLLM reports it."""
    text = " red green blue"
    length = SequenceDetails(None, RequestStatus.FINISHED_LENGTH, None, 0, None, None, False)
    params = SamplingParams(stop=" blue", max_tokens=len(smollm2_tokenizer.encode(text, add_special_tokens=False)),
                            output_kind=RequestOutputKind.CUMULATIVE)
    *_, last = _feed(smollm2_tokenizer, params, text, length)
    assert (last.text, last.finish_reason, last.stop_reason) == (" red green", "stop", " blue")


def test_a_cumulative_output_never_takes_text_back(smollm2_tokenizer):
    """A cumulative output holds the text streamed so far: what might start a stop string waits, as a
    delta's does, instead of being shown and then cut."""
    params = SamplingParams(stop=" more STOP", max_tokens=20, output_kind=RequestOutputKind.CUMULATIVE)
    outputs = _feed(smollm2_tokenizer, params, " world more STOP")
    texts = [o.text for o in outputs]
    assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(texts)), texts
    assert texts[-1] == " world" and outputs[-1].finish_reason == "stop"
