"""Multi-LoRA serving in the engine: each adapter's outputs are those of the base model with the adapter
merged into its weights (a model of its own), whichever adapters and base-model requests share its steps,
with slots written as adapters come and go, under async scheduling, multi-step decoding and drafting."""

from collections.abc import Iterator

import numpy as np
import pytest

from jaxserve import LLM, LoRARequest
from jaxserve.config import LoraModule
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.sampling_params import InvalidParam, SamplingParams
from tests.engine.helpers import LADDER, make_engine, make_prompts, require_ranks
from tests.lora_helpers import write_adapter, write_merged

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL = (*ATTENTION, "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def lora_dirs(tiny_model_dir, tmp_path_factory):
    """The base model, three adapters (all projections; attention only, rsLoRA; a rank-8 one) and each
    adapter merged into the base model's weights."""
    base = tiny_model_dir("llama")
    root = tmp_path_factory.mktemp("lora")
    adapters = {
        "all": write_adapter(root / "all", base, ALL, rank=4, alpha=8.0, seed=1),
        "attn": write_adapter(root / "attn", base, ATTENTION, rank=2, alpha=4.0, seed=2, rslora=True),
        "wide": write_adapter(root / "wide", base, ("q_proj", "v_proj", "down_proj"), rank=8, alpha=8.0, seed=3),
    }
    merged = {name: write_merged(root / f"merged-{name}", base, path) for name, path in adapters.items()}
    return base, adapters, merged


def _lora_engine(lora_dirs, max_loras: int, **overrides) -> LLMEngine:
    base, adapters, _ = lora_dirs
    modules = tuple(f"{name}={path}" for name, path in adapters.items())
    return make_engine(base, warmup=False, enable_lora=True, lora_modules=modules, max_loras=max_loras, **overrides)


def _params(max_tokens: int = 8, **extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, **extra)


def _run(engine: LLMEngine, requests: list[tuple[str, list[int], str | None]], params: SamplingParams,
         running: list[list[str]] | None = None) -> dict[str, tuple[list[int], list[float]]]:
    """Runs (id, prompt, adapter) requests together; returns each one's tokens and logprobs. `running`
    collects the adapters each step ran."""
    for request_id, prompt, adapter in requests:
        engine.add_request(request_id, prompt, params, lora_name=adapter)
    results = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                completion = output.outputs[0]
                results[output.request_id] = (list(completion.token_ids), list(completion.token_logprobs or []))
        if running is not None:
            names = {lora_id: module.name for module, lora_id in engine.lora_modules.values()}
            running.append([names[i] for i in engine.scheduler.lora_slots.running_adapters])
    return results


_REFERENCE_ENGINES: dict[str, LLMEngine] = {}


@pytest.fixture(scope="module", autouse=True)
def _reference_engines_live_for_the_module() -> Iterator[None]:
    yield
    _REFERENCE_ENGINES.clear()


def _reference_engine(model_dir) -> LLMEngine:
    """The engine of a reference model (the base model, or an adapter merged into it), built once for the
    module. Prefix caching is off, so every run computes its requests anew, as a new engine would."""
    key = str(model_dir)
    if key not in _REFERENCE_ENGINES:
        _REFERENCE_ENGINES[key] = make_engine(model_dir, warmup=False, enable_prefix_caching=False)
    engine = _REFERENCE_ENGINES[key]
    assert not engine.has_unfinished_requests(), "an earlier test left requests on the reference engine"
    return engine


def _references(lora_dirs, requests, params) -> dict[str, tuple[list[int], list[float]]]:
    """Each request run on its reference model: the base model, or its adapter merged."""
    base, _, merged = lora_dirs
    results = {}
    for model_dir in {None: base, **merged}.values():
        mine = [(rid, prompt, None) for rid, prompt, adapter in requests if (merged.get(adapter) or base) == model_dir]
        if mine:
            results.update(_run(_reference_engine(model_dir), mine, params))
    return results


def _assert_matches(results, references) -> None:
    assert results.keys() == references.keys()
    for request_id, (tokens, logprobs) in results.items():
        assert tokens == references[request_id][0], request_id
        np.testing.assert_allclose(logprobs, references[request_id][1], rtol=1e-4, atol=1e-4, err_msg=request_id)


def _requests(adapters: list[str | None]) -> list[tuple[str, list[int], str | None]]:
    prompts = make_prompts(8)
    return [(f"r{i}-{adapter}", prompts[i % len(prompts)], adapter) for i, adapter in enumerate(adapters)]


@pytest.mark.gpu  # in `make test-gpu`: the masked slot products on a GPU's dots
def test_adapters_and_base_in_one_step_match_their_merged_models(lora_dirs):
    """Requests of three adapters and of the base model, batched together in three slots, each give what
    its own model gives alone: the adapter merged into the weights, or the base model (which no adapter
    touches). An adapter's outputs differ from the base model's: the adapters do change the model."""
    requests = _requests(["all", None, "attn", "wide", "all", None, "wide", "attn"])
    params = _params()
    engine = _lora_engine(lora_dirs, max_loras=3)
    running: list[list[str]] = []
    results = _run(engine, requests, params, running)
    references = _references(lora_dirs, requests, params)
    _assert_matches(results, references)
    assert ["all", "attn", "wide"] in running  # they did share steps
    base_alone = _run(_reference_engine(lora_dirs[0]), [(rid, p, None) for rid, p, _ in requests], params)
    assert all(results[rid][0] != base_alone[rid][0] for rid, _, adapter in requests if adapter is not None)


def test_more_adapters_than_slots_take_turns(lora_dirs):
    """With one slot, requests of three adapters run one adapter at a time (base-model requests beside any),
    the slot written whenever its adapter changes, and every output is still its merged model's."""
    requests = _requests(["all", "attn", None, "wide", "all", "attn"])
    params = _params(6)
    engine = _lora_engine(lora_dirs, max_loras=1)
    running: list[list[str]] = []
    results = _run(engine, requests, params, running)
    _assert_matches(results, _references(lora_dirs, requests, params))
    assert max(len(adapters) for adapters in running) == 1
    writer = engine.runner.lora
    assert writer.num_writes >= 3
    assert engine.scheduler.lora_slots.running_adapters == []


def test_prefix_cache_keeps_adapters_apart(lora_dirs):
    """A prompt the base model has cached is computed again under an adapter (its K/V differ there), and an
    adapter's cached prefix serves that adapter's next request."""
    prompt = make_prompts(8)[3]  # 40 tokens: ten full pages
    params = _params(5)
    engine = _lora_engine(lora_dirs, max_loras=1)
    first = _run(engine, [("base", prompt, None)], params)
    hits = engine.scheduler.prefix_cache_hits
    second = _run(engine, [("all", prompt, "all")], params)
    assert engine.scheduler.prefix_cache_hits == hits  # nothing of the base model's pages
    third = _run(engine, [("all-again", prompt, "all")], params)
    assert engine.scheduler.prefix_cache_hits > hits  # its own
    references = _references(lora_dirs, [("base", prompt, None), ("all", prompt, "all")], params)
    _assert_matches({**first, **second}, references)
    assert third["all-again"][0] == references["all"][0]


@pytest.mark.parametrize("overrides", [
    pytest.param(dict(async_scheduling=True), id="async"),
    pytest.param(dict(num_scheduler_steps=4), id="multi-step"),
    pytest.param(dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3}), id="drafting"),
])
def test_adapters_under_async_multi_step_and_drafting(lora_dirs, overrides):
    """The per-token slots follow a request through every step kind: pending tokens fed on the device,
    several decode steps in one call, and drafts verified on rows of their own."""
    requests = _requests(["all", None, "wide", "attn"])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine = _lora_engine(lora_dirs, max_loras=2, **overrides)
    results = _run(engine, requests, params)
    references = _references(lora_dirs, requests, params)
    assert {rid: tokens for rid, (tokens, _) in results.items()} == {
        rid: tokens for rid, (tokens, _) in references.items()}


def test_unknown_adapter_is_refused_and_base_requests_take_no_slot(lora_dirs):
    """A request names an adapter the engine serves or none; an unknown name is refused before it queues."""
    engine = _lora_engine(lora_dirs, max_loras=1)
    with pytest.raises(InvalidParam, match="does not exist"):
        engine.add_request("x", [5, 6, 7], _params(), lora_name="missing")
    assert not engine.has_unfinished_requests()
    assert list(engine.lora_modules) == ["all", "attn", "wide"]
    running: list[list[str]] = []
    _run(engine, [("plain", [5, 6, 7], None)], _params(2), running)
    assert running and all(adapters == [] for adapters in running)
    assert engine.runner.lora.num_writes == 0


def test_adapter_above_the_slot_rank_fails_the_start(lora_dirs, tmp_path):
    base = lora_dirs[0]
    adapter = write_adapter(tmp_path / "r16", base, ATTENTION, rank=16)
    with pytest.raises(ValueError, match="rank 16 is above --max-lora-rank 8"):
        make_engine(base, enable_lora=True, lora_modules=(f"r16={adapter}",), max_lora_rank=8, warmup=False)


def test_an_adapter_loaded_while_serving_and_one_removed_while_its_request_runs(lora_dirs):
    """An adapter added after start-up serves its requests; removing one refuses its new requests at once
    while its running request finishes with it, and its weights leave the core after that request."""
    base, adapters, _ = lora_dirs
    engine = make_engine(base, warmup=False, enable_lora=True, max_loras=2)
    assert engine.lora_modules == {}
    with pytest.raises(ValueError, match="cannot read"):
        engine.load_lora(LoraModule("bad", str(base)))  # a model directory, not an adapter
    engine.load_lora(LoraModule("all", str(adapters["all"])))
    with pytest.raises(ValueError, match="already been loaded"):
        engine.load_lora(LoraModule("all", str(adapters["attn"])))
    requests = _requests(["all", None])
    params = _params(10)
    for request_id, prompt, adapter in requests:
        engine.add_request(request_id, prompt, params, lora_name=adapter)
    engine.step()  # the adapter's request runs
    (lora_id,) = [i for _, i in engine.lora_modules.values()]
    engine.remove_lora("all")
    with pytest.raises(InvalidParam, match="does not exist"):
        engine.add_request("late", [5, 6], params, lora_name="all")
    assert lora_id in engine.runner.lora.adapters  # its request still runs with it
    results = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                results[output.request_id] = (list(output.outputs[0].token_ids), list(output.outputs[0].token_logprobs))
    engine.step()
    assert lora_id not in engine.runner.lora.adapters
    _assert_matches(results, _references(lora_dirs, requests, params))
    with pytest.raises(KeyError):
        engine.remove_lora("all")
    engine.load_lora(LoraModule("all", str(adapters["attn"])))  # the name again, another adapter: a new id
    assert engine.lora_modules["all"][1] != lora_id


def test_offline_lora_requests_load_on_first_use(lora_dirs):
    """vLLM's `LLM.generate(..., lora_request=LoRARequest(name, id, path))`, for all prompts or per prompt."""
    base, adapters, _ = lora_dirs
    llm = LLM(model=str(base), dtype="float32", enable_lora=True, max_loras=2, max_model_len=256,
              num_kv_pages=256, page_size=4, compilation_cache_dir=None, **LADDER)
    prompts = make_prompts(3)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    attn = LoRARequest("attn", 1, str(adapters["attn"]))
    mixed = llm.generate(prompts, params, use_tqdm=False,
                         lora_request=[attn, None, LoRARequest("wide", 2, str(adapters["wide"]))])
    alone = llm.generate(prompts[:1], params, use_tqdm=False, lora_request=attn)
    assert mixed[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    requests = [("0", prompts[0], "attn"), ("1", prompts[1], None), ("2", prompts[2], "wide")]
    references = _references(lora_dirs, requests, params)
    assert [list(o.outputs[0].token_ids) for o in mixed] == [references[r][0] for r, _, _ in requests]
    with pytest.raises(ValueError, match="is loaded from"):
        llm.generate(prompts[:1], params, use_tqdm=False, lora_request=LoRARequest("attn", 1, str(adapters["all"])))
    with pytest.raises(ValueError, match="2 prompts but 1 LoRA requests"):
        llm.generate(prompts[:2], params, use_tqdm=False, lora_request=[attn])


@pytest.mark.slow
@pytest.mark.parametrize("processes", [{"engine_process": True}, {"data_parallel_size": 2}], ids=["core", "dp2"])
def test_adapters_in_engine_processes(lora_dirs, processes):
    """With the core in its own process, adapters cross the pipe as arrays and serve the same outputs; with
    two data-parallel ranks, every rank has every adapter (the requests alternate between them)."""
    if "data_parallel_size" in processes:
        require_ranks(2)
    requests = _requests(["wide", "all", None, "wide"])
    params = _params(6)
    engine = _lora_engine(lora_dirs, max_loras=2, **processes)
    try:
        results = _run(engine, requests, params)
        if "data_parallel_size" in processes:
            assert engine._core.router.routed == [2, 2]
        engine.remove_lora("wide")
    finally:
        engine.shutdown()
    _assert_matches(results, _references(lora_dirs, requests, params))


@pytest.mark.parametrize(("kind", "targets"), [
    pytest.param("qwen3", ALL, id="qwen3"),  # per-head norms after the projections
    pytest.param("gemma2", ALL, id="gemma2"),
    pytest.param("gemma3", ALL, id="gemma3"),
    pytest.param("phi3", ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), id="phi3-fused"),
    pytest.param("mixtral", ATTENTION, id="mixtral-attention"),  # experts have no stacks
    pytest.param("glm4", ("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"), id="glm4"),
])
def test_every_family_serves_adapters_as_their_merged_models(tiny_model_dir, tmp_path, kind, targets):
    """Each family's adapter, beside a base-model request in the same steps, gives the merged model's
    outputs: Phi-3's fused projections split into their stacks, a mixture's attention adapted, and GLM-4's q and k
    B rows reordered as its weights' rows are (`rope_layout`)."""
    base = tiny_model_dir(kind)
    adapter = write_adapter(tmp_path / "adapter", base, targets, rank=4, alpha=8.0, seed=11)
    merged = write_merged(tmp_path / "merged", base, adapter)
    prompts = make_prompts(2)
    params = _params(6)
    engine = make_engine(base, warmup=False, enable_lora=True, lora_modules=(f"a={adapter}",))
    results = _run(engine, [("a", prompts[0], "a"), ("base", prompts[1], None)], params)
    on_base = _run(make_engine(base, warmup=False), [("base", prompts[1], None), ("x", prompts[0], None)], params)
    expected = {**_run(make_engine(merged, warmup=False), [("a", prompts[0], None)], params), "base": on_base["base"]}
    _assert_matches(results, expected)
    unadapted = on_base["x"]
    assert results["a"][0] != unadapted[0] or not np.allclose(results["a"][1], unadapted[1], atol=1e-3)


def test_a_family_without_adapter_stacks_is_refused_at_start(tiny_model_dir):
    with pytest.raises(ValueError, match="--enable-lora: not supported for GPT2LMHeadModel"):
        make_engine(tiny_model_dir("gpt2"), warmup=False, enable_lora=True)


def test_async_engine_loads_race_and_an_unload_lets_its_stream_finish(lora_dirs):
    """Through the AsyncEngine, as the server drives it: of two loads of one name at once, one serves and
    the other is refused; an unload while a request of the adapter streams lets that stream finish with
    every token its merged model gives, and refuses the next request."""
    import asyncio

    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.engine.llm_engine import AdapterExists

    base, adapters, _ = lora_dirs
    engine = AsyncEngine(make_engine(base, warmup=False, enable_lora=True, max_loras=2))
    prompt, params = make_prompts(4)[3], _params(12)

    async def scenario() -> tuple[list, list[int]]:
        loads = await asyncio.gather(*(engine.load_lora(LoraModule("all", str(adapters["all"])))
                                       for _ in range(2)), return_exceptions=True)
        stream = engine.generate(prompt, params, "streamed", lora_name="all")
        first = await anext(stream)
        await engine.remove_lora("all")
        outputs = [first] + [output async for output in stream]
        with pytest.raises(InvalidParam, match="does not exist"):
            async for _ in engine.generate(prompt, params, "late", lora_name="all"):
                pass
        return loads, list(outputs[-1].outputs[0].token_ids)

    try:
        loads, tokens = asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert sum(load is None for load in loads) == 1 and any(isinstance(load, AdapterExists) for load in loads)
    assert tokens == _references(lora_dirs, [("streamed", prompt, "all")], params)["streamed"][0]
