"""Multi-step decoding (`--num-scheduler-steps k`): k decode steps in one jitted call give the single-step
loop's outputs exactly (greedy and seeded tokens, stop ids, stop strings, EOS, max_tokens inside a run),
wastes at most k - 1 tokens per finished request, serves penalties, biases and allowed tokens k steps a
call too, falls back to single steps while anything else runs, and compiles nothing after warm-up."""

import pytest

from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.sampling_params import SamplingParams
from tests.engine.helpers import assert_same, make_engine, make_prompts, run, stop_requests, workload
from tests.helpers import count_compilations

STEPS = 4


@pytest.fixture(scope="module")
def engines(llama_dir) -> dict[str, LLMEngine]:
    return {
        "single": make_engine(llama_dir),
        "multi": make_engine(llama_dir, num_scheduler_steps=STEPS),
        "multi-async": make_engine(llama_dir, num_scheduler_steps=STEPS, async_scheduling=True,
                                   greedy_decodes=True),
    }


def plain_requests(engine: LLMEngine) -> tuple[dict, dict]:
    """Requests multi-step decoding serves: greedy and seeded, lengths that end inside a k-step run, stops."""
    prompts = make_prompts(8)
    greedy = dict(temperature=0.0, ignore_eos=True)
    requests = {
        "greedy-13": (prompts[0], SamplingParams(max_tokens=13, **greedy)),
        "greedy-1": (prompts[5], SamplingParams(max_tokens=1, **greedy)),
        "greedy-6": (prompts[2], SamplingParams(max_tokens=6, **greedy)),
        "seeded-n2": (prompts[1], SamplingParams(n=2, temperature=0.9, top_p=0.9, top_k=50, seed=7, max_tokens=14,
                                                 ignore_eos=True)),
        "with-eos": (prompts[4], SamplingParams(max_tokens=30, temperature=1.3, seed=2)),
        **stop_requests(engine, prompts[7]),
        "late": (prompts[3], SamplingParams(max_tokens=9, **greedy)),
    }
    arrivals = {"greedy-13": 0, "greedy-1": 0, "greedy-6": 1, "seeded-n2": 1, "with-eos": 2, "stop-id": 2,
                "stop-string": 3, "late": 12}
    return requests, arrivals


def test_multi_step_outputs_equal_single_steps(engines):
    requests, arrivals = plain_requests(engines["single"])
    single = run(engines["single"], requests, arrivals)
    assert single["stop-id"].outputs[0].finish_reason == "stop"
    assert isinstance(single["stop-string"].outputs[0].stop_reason, str)
    for name in ("multi", "multi-async"):
        engine = engines[name]
        engine.runner.num_multi_steps = 0
        with count_compilations() as compiled:
            multi = run(engine, requests, arrivals)
        assert compiled == [], f"{name} compiled after warm-up: {compiled}"
        assert engine.runner.num_multi_steps > 0, f"{name} never ran a multi-step decode"
        assert_same(single, multi)


def decode_positions(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> tuple[list[int], int]:
    """Runs one request; returns its tokens and the positions past its prompt the runner computed."""
    scheduler = engine.scheduler
    computed = []
    update, update_steps = scheduler.update, scheduler.update_steps

    def counting_update(plan, output):
        computed.extend(1 for start in plan.start_positions if start >= len(prompt))  # a decode
        return update(plan, output)

    def counting_update_steps(plan, outputs):
        computed.append(sum(plan.decode_steps))
        return update_steps(plan, outputs)

    scheduler.update, scheduler.update_steps = counting_update, counting_update_steps
    try:
        return run(engine, {"r": (prompt, params)}, {"r": 0})["r"].outputs[0].token_ids, sum(computed)
    finally:
        del scheduler.update, scheduler.update_steps


def test_a_run_never_computes_past_max_tokens(engines):
    prompt = make_prompts(2)[1]
    for max_tokens in range(1, 2 * STEPS + 2):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        tokens, computed = decode_positions(engines["multi"], prompt, params)
        assert len(tokens) == max_tokens
        assert computed == max_tokens - 1, "the prefill samples the first token, each decode one more"


def test_a_stopped_request_wastes_at_most_k_minus_1_tokens_or_2k_minus_1_overlapped(engines):
    """Synchronous k-step calls see a stop when its call is read; overlapped ones (async scheduling) one call
    later, as async single steps see a stop one step late."""
    prompt = make_prompts(2)[1]
    greedy = dict(temperature=0.0, ignore_eos=True)
    probe = run(engines["single"], {"p": (prompt, SamplingParams(max_tokens=30, **greedy))}, {"p": 0})
    tokens = probe["p"].outputs[0].token_ids
    for stop_at in (2, 5, 9, 14):
        if tokens[stop_at] in tokens[:stop_at]:
            continue  # an earlier copy would stop it first
        params = SamplingParams(max_tokens=30, stop_token_ids=[tokens[stop_at]], **greedy)
        for name in ("multi", "multi-async"):
            engines[name].runner.num_multi_steps = 0
            stopped, computed = decode_positions(engines[name], prompt, params)
            assert stopped == tokens[: stop_at + 1]
            assert engines[name].runner.num_multi_steps > 0
            wasted = STEPS - 1 if name == "multi" else 2 * STEPS - 1
            assert stop_at <= computed <= stop_at + wasted, name


def row_filled_requests() -> tuple[dict, dict]:
    """Requests whose rows the runner fills, all of whose decodes may run k to a call: penalties (counted on
    the device between the steps), logit_bias, allowed tokens, min_tokens once its bans are over, prompt
    logprobs once the prompt is in."""
    prompts = make_prompts(8)
    greedy = dict(temperature=0.0, ignore_eos=True)
    requests = {
        "repetition": (prompts[7], SamplingParams(max_tokens=18, repetition_penalty=1.5, **greedy)),
        "frequency": (prompts[3], SamplingParams(max_tokens=15, temperature=1.0, seed=4, frequency_penalty=1.5,
                                                 presence_penalty=0.5, ignore_eos=True)),
        "negative": (prompts[0], SamplingParams(max_tokens=14, frequency_penalty=-1.0, **greedy)),
        "bias": (prompts[1], SamplingParams(max_tokens=13, logit_bias={100: 30.0, 200: 29.5}, **greedy)),
        "allowed": (prompts[2], SamplingParams(max_tokens=16, temperature=1.0, seed=6,
                                               allowed_token_ids=[11, 12, 13, 1000, 20000])),
        "min-tokens": (prompts[4], SamplingParams(max_tokens=17, min_tokens=6, temperature=1.2, seed=1)),
        "prompt-logprobs": (prompts[6], SamplingParams(max_tokens=11, prompt_logprobs=2, **greedy)),
    }
    arrivals = {"repetition": 0, "frequency": 0, "negative": 1, "bias": 1, "allowed": 2, "min-tokens": 2,
                "prompt-logprobs": 3}
    return requests, arrivals


def test_rows_the_runner_fills_decode_k_steps_a_call_with_the_same_outputs(engines):
    requests, arrivals = row_filled_requests()
    single = run(engines["single"], requests, arrivals)
    assert single["repetition"].outputs[0].token_ids != run(engines["single"], {"plain": (
        requests["repetition"][0], SamplingParams(max_tokens=18, temperature=0.0, ignore_eos=True))},
        {"plain": 0})["plain"].outputs[0].token_ids, "the penalty changes the output"
    for name in ("multi", "multi-async"):
        engine = engines[name]
        scheduler, in_k_steps = engine.scheduler, set()
        update_steps = scheduler.update_steps

        def noting_update_steps(plan, outputs, seen=in_k_steps, update=update_steps):
            seen.update(plan.request_ids)
            return update(plan, outputs)

        scheduler.update_steps = noting_update_steps
        try:
            with count_compilations() as compiled:
                multi = run(engine, requests, arrivals)
        finally:
            del scheduler.update_steps
        assert compiled == [], f"{name} compiled after warm-up: {compiled}"
        assert {seq_id.split("#")[0] for seq_id in in_k_steps} == set(requests), in_k_steps
        assert_same(single, multi)


def test_everything_else_runs_single_steps_with_the_same_outputs(engines):
    """The async workload (penalties, logprobs, grammar, min_tokens, prefix hits): single steps wherever a
    request needs them, multi-step decodes when only plain decodes are left."""
    requests, arrivals = workload(engines["single"])
    single = run(engines["single"], requests, arrivals)
    multi = run(engines["multi-async"], requests, arrivals)
    assert_same(single, multi)


def test_a_first_token_does_not_wait_for_the_k_steps(engines):
    """The first token is reported before any k-step call is read: synchronously before one is launched,
    overlapped (async) in the call that launches the first, while it runs."""
    for name in ("multi", "multi-async"):
        engine = engines[name]
        engine.runner.num_multi_steps = 0
        runner, reads = engine.runner, []
        collect_steps = runner.collect_steps
        runner.collect_steps = lambda launched, reads=reads, collect=collect_steps: (
            reads.append(launched) or collect(launched))
        try:
            engine.add_request("first", make_prompts(1)[0], SamplingParams(max_tokens=20, temperature=0.0,
                                                                           ignore_eos=True))
            outputs = []
            while not outputs:
                outputs = engine.step()
            assert len(outputs[0].outputs[0].token_ids) == 1
            assert reads == [], f"{name}: the first token came after a multi-step decode"
            assert runner.num_multi_steps == (name == "multi-async"), "overlapped: launched, not read"
            while engine.has_unfinished_requests():
                engine.step()
            assert runner.num_multi_steps > 0 and reads
        finally:
            del runner.collect_steps
