"""A background warm-up: the engine is ready after one bucket, steps run in the smallest compiled bucket
that holds them meanwhile, every token is what a fully warmed engine produces, and once every bucket is
in nothing compiles again."""

from tests.engine.helpers import greedy, make_engine, make_prompts
from tests.helpers import count_compilations


def run_all(engine, prompts, max_tokens=6) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy(max_tokens))
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output.outputs[0].token_ids
    return done


def test_ready_after_one_bucket_and_the_same_tokens_while_the_rest_compile(llama_dir):
    prompts = make_prompts()
    want = run_all(make_engine(llama_dir), prompts)

    engine = make_engine(llama_dir, background_warmup=True)
    runner = engine.runner
    largest = max(b for b in runner.ladder.all_buckets() if not b.decode_only)
    runner.stop_warmup()  # freeze the table (the compiles under way finish), so fallbacks are certain to serve
    compiled = set(runner._compiled)
    assert largest in compiled
    missing = set(runner.ladder.all_buckets()) - compiled
    assert missing, "stopped right after start: most buckets were still to compile"
    for wanted in missing:
        used = runner._runnable_bucket(wanted)
        assert used in compiled and used.num_tokens >= wanted.num_tokens and used.num_reqs >= wanted.num_reqs
        assert wanted.decode_only or not used.decode_only  # a mixed step never lands in a decode bucket
    assert run_all(engine, prompts) == want


def test_once_every_bucket_is_in_nothing_compiles(llama_dir):
    engine = make_engine(llama_dir, background_warmup=True)
    engine.runner.wait_for_warmup()
    assert set(engine.runner._compiled) == set(engine.runner.ladder.all_buckets())
    with count_compilations() as compiles:
        assert run_all(engine, make_prompts()[:4])
    assert compiles == []
    engine.shutdown()
