"""The greedy variant of the decode buckets (`--greedy-decodes`): the same tokens as the full sampler, run
only when every row of a step is greedy and asks for nothing more, and nothing compiled after warm-up."""

from jaxserve.sampling_params import SamplingParams
from tests.engine.helpers import greedy, make_engine, make_prompts, run_staggered
from tests.helpers import count_compilations


def test_greedy_decodes_give_the_full_sampler_s_tokens(llama_dir):
    prompts = make_prompts(6)
    lengths, arrivals = [9, 4, 12, 7, 10, 5], [0, 0, 1, 3, 3, 6]
    full = make_engine(llama_dir)
    expected = run_staggered(full, prompts, lengths, arrivals)
    assert full.runner.num_greedy_steps == 0
    fast = make_engine(llama_dir, greedy_decodes=True)
    with count_compilations() as compiles:
        assert run_staggered(fast, prompts, lengths, arrivals) == expected
    assert compiles == [], "every variant was compiled at warm-up"
    assert fast.runner.num_greedy_steps > 0, "the plain greedy decodes ran the greedy variant"


def test_a_row_that_asks_for_more_keeps_its_step_on_the_full_sampler(llama_dir):
    engine = make_engine(llama_dir, greedy_decodes=True)
    prompts = make_prompts(2)
    engine.add_request("plain", prompts[0], greedy(6))
    engine.add_request("logprobs", prompts[1], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                              logprobs=2))
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output
    assert engine.runner.num_greedy_steps == 0, "a row with logprobs: every step on the full sampler"
    assert all(len(top) == 2 for top in outputs["logprobs"].outputs[0].top_logprobs)
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=4, ignore_eos=True)
    engine.add_request("sampled", prompts[0], sampled)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.runner.num_greedy_steps == 0, "a sampled row: the full sampler"
