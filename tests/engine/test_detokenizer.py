"""Incremental detokenization equals a full decode; stop strings cut and hold back text."""

from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.sampling_params import SamplingParams


def stream(tokenizer, prompt_ids, token_ids, params):
    detok = IncrementalDetokenizer.for_prompt(tokenizer, prompt_ids, params)
    deltas, stopped = [], False
    for token in token_ids:
        stopped = detok.add_tokens([token])
        deltas.append(detok.take_delta(finished=stopped))
        if stopped:
            break
    if not stopped:
        deltas.append(detok.take_delta(finished=True))
    return detok, "".join(deltas), stopped


def test_incremental_text_equals_full_decode(smollm2_tokenizer):
    text = "Héllo wörld! 東京 is big 🙂 — done.\nNew line"
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    prompt = smollm2_tokenizer.encode("Say:", add_special_tokens=False)
    detok, streamed, stopped = stream(smollm2_tokenizer, prompt, ids, SamplingParams())
    assert not stopped
    assert detok.text == streamed == smollm2_tokenizer.decode(ids)


def test_stop_string_truncates_and_is_never_streamed(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("The answer is forty two. STOP here please", add_special_tokens=False)
    detok, streamed, stopped = stream(smollm2_tokenizer, [], ids, SamplingParams(stop=["STOP", "nothing"]))
    assert stopped and detok.stop_reason == "STOP"
    assert streamed == detok.text == "The answer is forty two. "
    kept = stream(smollm2_tokenizer, [], ids, SamplingParams(stop="STOP", include_stop_str_in_output=True))[0]
    assert kept.text == "The answer is forty two. STOP"
