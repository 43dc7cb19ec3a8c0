"""What EngineCore reports for a step: plain tokens as one TokenColumns, every other sequence's news as a
SequenceUpdate (pure Python: a real scheduler, the runner's results given; no model)."""

from types import SimpleNamespace

from jaxserve.engine.core import EngineCore
from jaxserve.engine.core_io import SequenceUpdate, TokenColumns
from jaxserve.engine.kv_cache_manager import KVCacheManager
from jaxserve.engine.request import Request, RequestStatus
from jaxserve.engine.scheduler import Scheduler, SchedulerOutput, StepOutput
from jaxserve.sampling_params import SamplingParams


class GivenTokens:
    """A runner whose steps sample token 7 + the step's index for every row, with top logprobs for the rows
    that asked."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler, self.steps = scheduler, 0

    def collect(self, launched: SimpleNamespace) -> StepOutput:
        out: SchedulerOutput = launched.scheduler_output
        ids = out.request_ids
        self.steps += 1
        tokens = [7 + self.steps] * len(ids)
        top = [{token: -0.5} if self.scheduler.requests[i].sampling_params.logprobs else None
               for i, token in zip(ids, tokens, strict=True)]
        return StepOutput(ids, tokens, [-0.5] * len(ids), top)


def test_plain_tokens_go_as_columns_and_anything_more_as_updates():
    scheduler = Scheduler(KVCacheManager(64, 8), max_num_seqs=8, max_num_batched_tokens=64)
    core = EngineCore.__new__(EngineCore)  # the step's bookkeeping only: no model, no runner
    core.scheduler, core.runner = scheduler, GivenTokens(scheduler)
    params = {"plain": dict(max_tokens=5), "preempted": dict(max_tokens=5), "top": dict(max_tokens=5, logprobs=2),
              "last": dict(max_tokens=2)}
    for name, extra in params.items():
        scheduler.add_request(Request(name, [1, 2, 3], SamplingParams(ignore_eos=True, **extra), eos_token_ids=(2,),
                                      max_model_len=64, sampling_seed=0))
    first = core._read(SimpleNamespace(scheduler_output=scheduler.schedule()))
    assert all(type(u) is SequenceUpdate and u.first is not None for u in first), "first tokens carry their facts"
    scheduler.requests["preempted"].num_preemptions = 1  # as if it had been preempted and resumed
    second = core._read(SimpleNamespace(scheduler_output=scheduler.schedule()))
    (columns,) = [u for u in second if type(u) is TokenColumns]
    assert columns.seq_ids == ["plain"] and columns.token_ids == [9] and columns.logprobs == [-0.5]
    records = {u.seq_id: u for u in second if type(u) is SequenceUpdate}
    assert set(records) == {"preempted", "top", "last"}
    assert records["preempted"].num_preemptions == 1, "a stop string may end it next: its count must be known"
    assert records["top"].top_logprobs == {9: -0.5}
    assert records["last"].status is RequestStatus.FINISHED_LENGTH
