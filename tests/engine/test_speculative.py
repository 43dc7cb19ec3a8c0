"""Speculative decoding by n-gram lookup (`--speculative-config`): a step that verifies drafts gives the
plain loop's outputs exactly (greedy and seeded tokens, logprobs, stop ids, stop strings, EOS, max_tokens
inside a run of drafts), accepts drafts where the output repeats its context, computes no position past a
request's limit, leaves no page behind, keys only computed pages for the prefix cache, and compiles
nothing after warm-up."""

import numpy as np
import pytest

from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.sampling_params import SamplingParams
from tests.engine.helpers import assert_same, drafting_workload, make_engine, make_prompts, run, stop_requests
from tests.helpers import count_compilations

# min 1: drafts on most steps of a random model's output, many of them rejected
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def engines(llama_dir) -> dict[str, LLMEngine]:
    return {
        "plain": make_engine(llama_dir),
        "speculative": make_engine(llama_dir, speculative_config=SPECULATIVE, enable_prefix_caching=True),
        "speculative-async": make_engine(llama_dir, speculative_config=SPECULATIVE, async_scheduling=True,
                                         greedy_decodes=True),
        "speculative-multi-step": make_engine(llama_dir, speculative_config=SPECULATIVE, num_scheduler_steps=3),
    }


def repeating_prompt(seed: int, period: int, length: int) -> list[int]:
    """A prompt that repeats a random run of `period` tokens: its continuation's n-grams are in it."""
    run_tokens = np.random.default_rng(seed).integers(3, 40000, size=period).tolist()
    return (run_tokens * (length // period + 1))[:length]


class ScriptedProposer:
    """Drafts from the plain engine's outputs (`truths`), every few proposals with one draft corrupted."""

    num_speculative_tokens = 3
    probes_cheaply = True
    last_round_steady = True

    def __init__(self, truths: dict[tuple, list[int]]) -> None:
        self.truths = truths
        self.num_proposals = 0

    def propose_batch(self, requests, max_drafts: list[int]) -> list[list[int]]:
        return [self.propose(request, limit) for request, limit in zip(requests, max_drafts, strict=True)]

    def propose(self, request, max_drafts: int) -> list[int]:
        truth = self.truths.get(truth_key(request))
        done = len(request.output_token_ids)
        if truth is None or max_drafts < 1:
            return []
        assert truth[:done] == request.output_token_ids, "the verified output left the plain one"
        drafts = truth[done : done + min(max_drafts, self.num_speculative_tokens)]
        self.num_proposals += 1
        wrong = self.num_proposals % (self.num_speculative_tokens + 2)  # past the drafts: none wrong
        if wrong < len(drafts):
            drafts[wrong] = 3 if drafts[wrong] != 3 else 4
        return drafts

    def finish(self, request) -> None:
        pass


def truth_key(request) -> tuple:
    """What fixes a sequence's output in both engines: its prompt, its seed where it samples, its stop ids."""
    params = request.sampling_params
    return (tuple(request.prompt_token_ids), request.sampling_seed if params.temperature else None,
            tuple(params.stop_token_ids))


def recorded_truths(engine: LLMEngine, requests: dict, arrivals: dict) -> tuple[dict, dict[tuple, list[int]]]:
    """Runs `requests` on the plain engine; returns its outputs and every sequence's tokens by `truth_key`
    (the longest where several share a key)."""
    truths: dict[tuple, list[int]] = {}
    scheduler = engine.scheduler
    remove = scheduler._remove

    def recording_remove(request):
        key = truth_key(request)
        if len(request.output_token_ids) > len(truths.get(key, ())):
            truths[key] = list(request.output_token_ids)
        remove(request)

    scheduler._remove = recording_remove
    try:
        return run(engine, requests, arrivals), truths
    finally:
        del scheduler._remove


def run_scripted(engine: LLMEngine, truths: dict, requests: dict, arrivals: dict, aborts: dict | None = None,
                 real_costs: bool = False, drafted_ids: set[str] | None = None) -> tuple[dict, int, int, int]:
    """Runs `requests` with `ScriptedProposer` drafting, every draft that fits run (steps cost alike, unless
    `real_costs`: the draft policy's own measurements); returns the outputs, the draft tokens, the accepted
    ones, and the accepted ones expected: each verified run's drafts before the first that differs from the
    plain engine's output. `drafted_ids` gets the requests of every step that verified drafts."""
    scheduler, counts = engine.scheduler, engine.scheduler.speculation
    policy, update_verified = scheduler.draft_policy, scheduler.update_verified
    before = counts.num_draft_tokens, counts.num_accepted_tokens
    expected = 0

    def expecting_update_verified(plan, output):
        nonlocal expected
        row = 0
        for num_drafts in plan.draft_lengths:
            request = scheduler.requests[plan.request_ids[row]]
            truth = truths[truth_key(request)][len(request.output_token_ids):]
            drafts = plan.token_ids[row + 1 : row + 1 + num_drafts]
            expected += next((i for i, (d, t) in enumerate(zip(drafts, truth, strict=False)) if d != t), num_drafts)
            if num_drafts and drafted_ids is not None:
                drafted_ids.add(request.request_id.split("#")[0])
            row += num_drafts + 1
        return update_verified(plan, output)

    real, scheduler.proposer = scheduler.proposer, ScriptedProposer(truths)
    scheduler.update_verified = expecting_update_verified
    costs = policy.costs
    if not real_costs:
        policy.observe_step = lambda *timed: None
        policy.costs = dict.fromkeys(policy.row_buckets, 1.0)
    try:
        with count_compilations() as compiled:
            outputs = run(engine, requests, arrivals, aborts)
    finally:
        scheduler.proposer, policy.costs = real, costs
        del scheduler.update_verified
        if not real_costs:
            del policy.observe_step
    assert compiled == [], f"compiled after warm-up: {compiled}"
    return outputs, counts.num_draft_tokens - before[0], counts.num_accepted_tokens - before[1], expected


@pytest.mark.parametrize("name", ["speculative", "speculative-async", "speculative-multi-step"])
def test_the_verification_accepts_exactly_the_right_drafts(engines, name):
    """Greedy and seeded requests that end on max_tokens only, drafted from the plain engine's outputs with
    one draft wrong every few proposals: the outputs are the plain engine's and the drafts accepted are
    exactly those before the first wrong one."""
    prompts = make_prompts(8)
    greedy = dict(temperature=0.0, ignore_eos=True)
    requests = {
        "greedy-30": (prompts[0], SamplingParams(max_tokens=30, **greedy)),
        "greedy-2": (prompts[5], SamplingParams(max_tokens=2, **greedy)),
        "greedy-7": (prompts[2], SamplingParams(max_tokens=7, **greedy)),
        "seeded-n2": (prompts[1], SamplingParams(n=2, temperature=0.9, top_p=0.9, top_k=50, seed=7, max_tokens=17,
                                                 ignore_eos=True)),
        "seeded-logprob": (prompts[6], SamplingParams(max_tokens=11, temperature=0.6, seed=4, logprobs=0,
                                                      ignore_eos=True)),
        "late": (prompts[3], SamplingParams(max_tokens=9, **greedy)),
        # each draft's row under the request's bias and allowed tokens, as its first row
        "biased": (prompts[4], SamplingParams(max_tokens=15, logit_bias={100: 30.0, 200: 29.8}, **greedy)),
        "allowed": (prompts[7], SamplingParams(max_tokens=16, temperature=1.0, seed=3, ignore_eos=True,
                                               allowed_token_ids=[11, 12, 13, 1000, 20000])),
        # each draft's row counting the drafts before it into its penalties, the accepted ones into its slot
        "penalized": (repeating_prompt(21, 5, 30), SamplingParams(max_tokens=24, repetition_penalty=1.4,
                                                                  frequency_penalty=0.7, presence_penalty=0.3,
                                                                  **greedy)),
        "penalized-seeded": (repeating_prompt(22, 4, 20), SamplingParams(max_tokens=18, temperature=0.7, seed=5,
                                                                         frequency_penalty=1.2, ignore_eos=True)),
    }
    arrivals = {"greedy-30": 0, "greedy-2": 0, "greedy-7": 1, "seeded-n2": 1, "seeded-logprob": 2, "late": 12,
                "biased": 2, "allowed": 3, "penalized": 18, "penalized-seeded": 19}
    plain, truths = recorded_truths(engines["plain"], requests, arrivals)
    drafted_ids: set[str] = set()
    speculative, drafted, accepted, expected = run_scripted(engines[name], truths, requests, arrivals,
                                                            drafted_ids=drafted_ids)
    assert_same(plain, speculative)
    assert accepted == expected
    assert 0 < accepted < drafted
    assert {"biased", "allowed", "penalized", "penalized-seeded"} <= drafted_ids, drafted_ids


def test_stops_inside_a_verified_run_end_where_plain_decoding_ends(engines):
    """Stop ids, stop strings, EOS and max_tokens that fall inside a run of accepted drafts: the tokens
    after them are dropped, and every output is the plain engine's."""
    prompts = make_prompts(8)
    requests = {
        **stop_requests(engines["plain"], prompts[7]),
        "with-eos": (prompts[4], SamplingParams(max_tokens=30, temperature=1.3, seed=2)),
        "greedy-5": (prompts[0], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)),
    }
    arrivals = dict.fromkeys(requests, 0)
    plain, truths = recorded_truths(engines["plain"], requests, arrivals)
    assert plain["stop-id"].outputs[0].finish_reason == "stop"
    assert isinstance(plain["stop-string"].outputs[0].stop_reason, str)
    for name in ("speculative", "speculative-async"):
        speculative, _, accepted, expected = run_scripted(engines[name], truths, requests, arrivals)
        assert_same(plain, speculative)
        assert accepted == expected > 0  # a draft that matches a sample past a stop counts, as in vLLM


def test_everything_else_gives_the_same_outputs(engines):
    """Penalties, logprobs, grammars, bans, prefix-cache hits, n > 1, with drafts proposed: the steps that
    run beside a grammar, bans or top logprobs decode without drafts, drafts run once every request decodes
    on the device, and every output is the plain engine's."""
    requests, arrivals = drafting_workload(engines["plain"])
    plain, truths = recorded_truths(engines["plain"], requests, arrivals)
    speculative, drafted, accepted, expected = run_scripted(engines["speculative-async"], truths, requests,
                                                            arrivals)
    assert_same(plain, speculative)
    assert drafted > 0 and accepted == expected


def test_with_multi_step_decoding_drafts_still_run_on_measured_costs(engines):
    """Multi-step decoding plans k steps where drafts do not run: the draft policy still gets the one-step
    time it needs (a plain step times the requests' own bucket), and drafts run on its real measurements."""
    prompts = make_prompts(8)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    requests, arrivals = {"a": (prompts[0], params), "b": (prompts[1], params)}, {"a": 0, "b": 0}
    plain, truths = recorded_truths(engines["plain"], requests, arrivals)
    engine = engines["speculative-multi-step"]
    speculative, drafted, accepted, expected = run_scripted(engine, truths, requests, arrivals, real_costs=True)
    assert_same(plain, speculative)
    assert drafted > 0 and accepted == expected
    assert 2 in engine.scheduler.draft_policy.costs  # the two requests' own bucket, timed


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 8])
def test_drafts_never_reach_past_max_tokens(engines, max_tokens):
    """A run of drafts is cut so that the positions computed end where the plain loop's do: the last
    output token is sampled, never computed."""
    prompt = make_prompts(1)[0]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    plain, truths = recorded_truths(engines["plain"], {"r": (prompt, params)}, {"r": 0})
    runner = engines["speculative"].core.runner
    launch, highest = runner.launch, []

    def recording_launch(plan):
        if not plan.is_empty:
            highest.append(max(start + n - 1 for start, n in zip(plan.start_positions, plan.num_new_tokens,
                                                                   strict=True)))
        return launch(plan)

    runner.launch = recording_launch
    try:
        outputs, drafted, _, _ = run_scripted(engines["speculative"], truths, {"r": (prompt, params)}, {"r": 0})
    finally:
        del runner.launch
    assert outputs["r"].outputs[0].token_ids == plain["r"].outputs[0].token_ids
    assert max(highest) == len(prompt) + max_tokens - 2
    assert (drafted > 0) == (max_tokens > 2)  # one token, or two: nothing left to draft


COPY_PROMPT = ("Copy the list exactly.\nList: apples, bananas, cherries, dates, elderberries, figs, grapes, "
               "honeydew, kiwis, lemons, mangoes, nectarines, oranges, papayas.\nCopy: apples, bananas,")
# vLLM's shape with lookups of 2-3 tokens: the list's items are 1-3 tokens long
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 2}


@pytest.fixture(scope="module")
def smollm2_engine(smollm2_gguf) -> LLMEngine:
    return make_engine(smollm2_gguf, speculative_config=NGRAM)


def plain_run(engine: LLMEngine, requests: dict, arrivals: dict) -> dict:
    """`requests` on `engine` with its proposer off: plain decoding on the same compiled steps."""
    scheduler = engine.scheduler
    proposer, scheduler.proposer = scheduler.proposer, None
    scheduler._draft_pause = 0  # a pause the last run left: without a proposer, nothing to resume
    try:
        return run(engine, requests, arrivals)
    finally:
        scheduler.proposer = proposer


@pytest.mark.slow
@pytest.mark.gpu  # in `make test-gpu`: on a GPU, where decode rows are nearly free, drafts run as they do here
def test_the_ngram_proposer_speeds_up_a_real_model_copying_its_prompt(smollm2_engine):
    """The bundled SmolLM2 copying a list from its prompt: the n-gram drafts are mostly accepted (the draft
    policy runs them on this CPU after timing the steps), the output takes far fewer steps than tokens, and
    it is token for token the plain loop's."""
    engine = smollm2_engine
    request = {"r": (engine.tokenizer.encode(COPY_PROMPT), SamplingParams(temperature=0.0, max_tokens=40,
                                                                           ignore_eos=True))}
    plain = plain_run(engine, request, {"r": 0})["r"].outputs[0]
    scheduler, counts = engine.scheduler, engine.scheduler.speculation
    steps = 0
    update_verified = scheduler.update_verified

    def counting(plan, output):
        nonlocal steps
        steps += 1
        return update_verified(plan, output)

    scheduler.update_verified = counting
    # The policy times the steps it chooses from: a step slowed by a test beside it can keep the drafting bucket
    # unchosen for a few dozen steps (its retries: `DraftPolicy`), so the request runs up to three times.
    try:
        for _ in range(3):
            steps = 0
            speculative = run(engine, request, {"r": 0})["r"].outputs[0]
            assert speculative.token_ids == plain.token_ids
            if steps < len(plain.token_ids) / 2:
                break
    finally:
        del scheduler.update_verified
    assert "cherries, dates, elderberries" in plain.text  # the model copies: the drafts have something to find
    assert counts.num_accepted_tokens >= counts.num_draft_tokens / 2
    assert steps < len(plain.token_ids) / 2
    stats = engine.stats()  # what /metrics reads
    assert (stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens) == (
        counts.num_draft_tokens, counts.num_accepted_tokens)
    assert sum(stats.spec_decode_accepted_per_position) == counts.num_accepted_tokens


@pytest.mark.slow
def test_the_core_in_its_own_process_drafts_with_the_same_outputs(smollm2_gguf, smollm2_engine):
    """`--engine-process`: the core's verification steps and their per-position outputs cross the pipe; the
    outputs (greedy and seeded) are plain decoding's, and the stats that come back count the drafts."""
    engine = make_engine(smollm2_gguf, speculative_config=NGRAM, engine_process=True)
    try:
        prompt = engine.tokenizer.encode(COPY_PROMPT)
        requests = {"greedy": (prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)),
                    "seeded": (prompt, SamplingParams(temperature=0.7, seed=5, max_tokens=30, ignore_eos=True))}
        arrivals = dict.fromkeys(requests, 0)
        plain = plain_run(smollm2_engine, requests, arrivals)
        assert_same(plain, run(engine, requests, arrivals))
        stats = engine.stats()
        assert stats.spec_decode_num_accepted_tokens > 0
        assert sum(stats.iteration_tokens_buckets) < 2 * 30, "fewer steps than tokens"
    finally:
        engine.shutdown()




def test_without_drafts_to_run_the_loop_overlaps_again(engines):
    """A request whose context has no repeated n-gram: after each plan where no draft ran, drafting pauses
    for twice as many steps as the last time, up to DRAFT_PAUSE_STEPS, which overlap host and device as async
    scheduling does (`run` checks that some step was in flight when the engine returned): drafts are looked
    for at pauses of 1, 2, 4, 8, 16, 16, ... steps."""
    from jaxserve.engine.scheduler import DRAFT_PAUSE_STEPS

    engine = engines["speculative-async"]
    scheduler = engine.scheduler
    plan_speculative, looked = scheduler._plan_speculative, []
    scheduler._plan_speculative = lambda: looked.append(1) or plan_speculative()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
        run(engine, {"r": (make_prompts(1)[0], params)}, {"r": 0})
    finally:
        del scheduler._plan_speculative
    assert DRAFT_PAUSE_STEPS == 16
    assert 5 <= len(looked) <= 8  # 48 tokens: looked for at about steps 1, 3, 6, 11, 20, 37


def test_above_disable_by_batch_size_no_proposal_is_asked(engines):
    """vLLM's disable_by_batch_size 1, with a proposer that finds nothing (so drafting pauses between its
    plans): a request alone is asked for drafts, and once two more arrive no proposal is asked until one runs
    alone again; the outputs are plain decoding's."""
    engine = engines["speculative"]
    scheduler, proposer = engine.scheduler, engine.scheduler.proposer
    asked_with = []
    proposer.propose_batch = lambda running, max_drafts: asked_with.append(len(scheduler.running)) or [
        [] for _ in running]
    scheduler.disable_by_batch_size = 1
    prompts = make_prompts(3)
    requests = {f"b{i}": (prompts[i], SamplingParams(temperature=0.0, max_tokens=40 - 12 * i, ignore_eos=True))
                for i in range(3)}
    arrivals = {"b0": 0, "b1": 6, "b2": 6}
    try:
        outputs = run(engine, requests, arrivals)
    finally:
        scheduler.disable_by_batch_size = None
        del proposer.propose_batch
    assert_same(run(engines["plain"], requests, arrivals), outputs)
    assert asked_with and max(asked_with) == 1


def test_the_prefix_cache_holds_only_computed_pages(engines):
    """After speculative runs with rejections and an abort (`run` checks that every page is free), a later
    request that hits the pages they cached gets the plain engine's output (a page keyed with a rejected
    draft's K/V would change it)."""
    prompt = repeating_prompt(7, 5, 37)
    greedy = SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True)
    requests, arrivals = {"a": (prompt, greedy), "b": (prompt[:20], greedy)}, {"a": 0, "b": 0}
    plain, truths = recorded_truths(engines["plain"], requests, arrivals)
    engine = engines["speculative"]
    first, drafted, accepted, _ = run_scripted(engine, truths, requests, arrivals, aborts={"b": 4})
    assert first["a"].outputs[0].token_ids == plain["a"].outputs[0].token_ids
    assert 0 < accepted < drafted
    continued = prompt + list(first["a"].outputs[0].token_ids)[:20]  # hits pages computed by verification
    hits_before = engine.scheduler.prefix_cache_hits
    again = run(engine, {"c": (continued, greedy)}, {"c": 0})
    assert engine.scheduler.prefix_cache_hits > hits_before
    reference = run(engines["plain"], {"c": (continued, greedy)}, {"c": 0})
    assert again["c"].outputs[0].token_ids == reference["c"].outputs[0].token_ids
