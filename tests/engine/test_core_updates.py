"""What EngineCore reports for a step: one CoreOutputs, every new token in its columns and details for the
sequences with more news (pure Python: a real scheduler, the runner's results given; no model)."""

from types import SimpleNamespace

import pytest

from jaxserve.engine.core import EngineCore
from jaxserve.engine.kv_cache_manager import KVCacheManager
from jaxserve.engine.request import Request, RequestStatus
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.step_io import SchedulerOutput, StepOutput
from jaxserve.sampling_params import InvalidParam, SamplingParams


class GivenTokens:
    """A runner whose steps sample token 7 + the step's index for every row, with top logprobs and a rank
    (the step's index) for the rows that asked, as the model runner's collect gives them."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler, self.steps = scheduler, 0

    def collect(self, launched: SimpleNamespace) -> StepOutput:
        out: SchedulerOutput = launched.scheduler_output
        ids = out.request_ids
        self.steps += 1
        tokens = [7 + self.steps] * len(ids)
        top = {row: {token: -0.5} for row, (i, token) in enumerate(zip(ids, tokens, strict=True))
               if self.scheduler.requests[i].sampling_params.logprobs}
        ranks = {row: self.steps for row, i in enumerate(ids)
                 if self.scheduler.requests[i].sampling_params.logprobs is not None}
        return StepOutput(ids, tokens, [-0.5] * len(ids), top, ranks)


def test_every_token_goes_in_the_columns_and_anything_more_in_details():
    scheduler = Scheduler(KVCacheManager(64, 8), max_num_seqs=8, max_num_batched_tokens=64)
    core = EngineCore.__new__(EngineCore)  # the step's bookkeeping only: no model, no runner
    core.scheduler, core.runner = scheduler, GivenTokens(scheduler)
    params = {"plain": dict(max_tokens=5), "preempted": dict(max_tokens=5), "top": dict(max_tokens=5, logprobs=2),
              "last": dict(max_tokens=2), "own": dict(max_tokens=5, logprobs=0)}
    for name, extra in params.items():
        scheduler.add_request(Request(name, [1, 2, 3], SamplingParams(ignore_eos=True, **extra), eos_token_ids=(2,),
                                      max_model_len=64, sampling_seed=0))
    (first,) = core._read(SimpleNamespace(scheduler_output=scheduler.schedule()))
    assert first.seq_ids == list(params) and set(first.details) == {0, 1, 2, 3, 4}
    assert all(detail.first is not None for detail in first.details.values()), "first tokens carry their facts"
    scheduler.requests["preempted"].num_preemptions = 1  # as if it had been preempted and resumed
    (second,) = core._read(SimpleNamespace(scheduler_output=scheduler.schedule()))
    assert second.seq_ids == list(params) and second.token_ids == [9] * 5 and second.logprobs == [-0.5] * 5
    assert not second.failures
    records = {second.seq_ids[index]: detail for index, detail in second.details.items()}
    assert set(records) == {"preempted", "top", "last", "own"}, "a plain token carries nothing more"
    assert records["preempted"].num_preemptions == 1, "a stop string may end it next: its count must be known"
    assert records["top"].top_logprobs == {9: -0.5} and records["top"].rank == 2
    assert records["own"].top_logprobs is None and records["own"].rank == 2, "logprobs=0: the token's rank alone"
    assert records["last"].status is RequestStatus.FINISHED_LENGTH


def test_an_end_on_eos_or_a_stop_id_is_marked_and_every_detail_crosses_the_core_process_pipe():
    """The core marks the token that ended a sequence on EOS or a stop id (its text is left out), not one
    that ended it by length; and a step's details reach the frontend whole through the core process's
    wire format, a pooled embedding and that mark included."""
    from jaxserve.engine.core_io import CoreOutputs, FirstToken, SequenceDetails
    from jaxserve.engine.core_process import from_wire, to_wire

    scheduler = Scheduler(KVCacheManager(64, 8), max_num_seqs=8, max_num_batched_tokens=64)
    core = EngineCore.__new__(EngineCore)
    core.scheduler, core.runner = scheduler, GivenTokens(scheduler)
    for name, extra in {"stop-id": dict(stop_token_ids=[9]), "eos": dict(), "length": dict(ignore_eos=True)}.items():
        scheduler.add_request(Request(name, [1, 2, 3], SamplingParams(max_tokens=2, **extra),
                                      eos_token_ids=(9,) if name == "eos" else (2,), max_model_len=64,
                                      sampling_seed=0))
    core._read(SimpleNamespace(scheduler_output=scheduler.schedule()))  # token 8
    (second,) = core._read(SimpleNamespace(scheduler_output=scheduler.schedule()))  # token 9: each ends
    records = {second.seq_ids[index]: detail for index, detail in second.details.items()}
    assert {name: (d.status, d.stop_token) for name, d in records.items()} == {
        "stop-id": (RequestStatus.FINISHED_STOPPED, True), "eos": (RequestStatus.FINISHED_STOPPED, True),
        "length": (RequestStatus.FINISHED_LENGTH, False)}
    detail = SequenceDetails({5: -0.1}, RequestStatus.FINISHED_STOPPED, 9, 2, FirstToken(1.5, 16, None), [0.25, -1.0],
                             True, 3)
    outputs = CoreOutputs(["a"], [9], [-0.1], 3.0, {0: detail}, [])
    assert from_wire(to_wire(outputs)) == outputs


def test_an_adapter_removed_while_a_request_of_it_waits_outside_the_scheduler_serves_it_first():
    """A core process compiles a request's grammar before the scheduler sees it. An adapter removed
    meanwhile (unload, or a replacement under its name) stayed only for the scheduler's requests: the
    compiled request was then refused ("adapter removed") although the frontend had accepted it. Now the
    adapter stays until that request ends, then goes."""
    scheduler = Scheduler(KVCacheManager(64, 8), max_num_seqs=8, max_num_batched_tokens=64, max_loras=1)
    core = EngineCore.__new__(EngineCore)
    adapter = SimpleNamespace(name="sql")
    core.scheduler, core.pooling_type = scheduler, "last"
    core.runner = SimpleNamespace(lora=SimpleNamespace(adapters={1: adapter}))
    core._retiring_loras = set()
    waiting = {1}  # adapter ids of the requests compiling outside the scheduler
    core.lora_waiting = lambda lora_id: lora_id in waiting
    core.remove_lora(1)
    assert core.runner.lora.adapters == {1: adapter}, "kept for the request still compiling"
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True), eos_token_ids=(2,),
                      max_model_len=64, sampling_seed=0, lora_id=1)
    waiting.clear()
    core.add_sequences([request])  # its grammar compiled: it joins the scheduler
    assert scheduler.uses_lora(1) and core.runner.lora.adapters == {1: adapter}
    core.finish(["r"], RequestStatus.FINISHED_ABORTED)
    assert core.runner.lora.adapters == {}, "gone once its last request ended"
    late = Request("late", [1, 2, 3], SamplingParams(max_tokens=2), eos_token_ids=(2,), max_model_len=64,
                   sampling_seed=0, lora_id=1)
    with pytest.raises(InvalidParam, match="was removed"):
        core.add_sequences([late])
