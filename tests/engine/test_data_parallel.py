"""Data parallelism: two engine cores in their own processes give the in-process engine's outputs.

The routing and the placements are pure Python and tested on their own (fake topologies, fake GPU lists).
The engine runs the core-process tests' workload (greedy and seeded sampling, n > 1, penalties, logprobs,
prompt logprobs, stops, a grammar, prefix-cache hits, aborts) on two ranks, each pinned to its CPU cores,
and every finished request must match the in-process engine's exactly.
"""

import asyncio
import multiprocessing
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from jaxserve.config import EngineConfig
from jaxserve.engine import data_parallel, placement
from jaxserve.engine.async_engine import AsyncEngine, EngineDeadError
from jaxserve.engine.core_io import CoreOutputs, EngineStats, SequenceDetails, SequenceFailure, failed
from jaxserve.engine.core_process import CoreProcessDied
from jaxserve.engine.data_parallel import DataParallelClient, SequenceRouter, combined_stats
from jaxserve.engine.placement import RankPlacement, physical_cores, placements, visible_gpus
from jaxserve.engine.request import RequestStatus
from jaxserve.sampling_params import SamplingParams
from tests.engine.helpers import (
    assert_aborts_leave_the_others_unchanged,
    assert_same,
    make_engine,
    make_prompts,
    require_ranks,
    run,
    run_short_requests,
    traced_jit_calls,
    workload,
)


def test_a_request_goes_whole_to_the_least_loaded_rank_ties_in_turn():
    router = SequenceRouter(3)
    assert [router.route([f"r{i}#0"]) for i in range(3)] == [0, 1, 2]  # an idle engine spreads its requests
    assert router.route(["n3#0", "n3#1", "n3#2"]) == 0  # n > 1: one rank, so the prompt's pages are shared
    assert router.loads == [4, 1, 1]
    assert router.route(["a#0"]) == 1 and router.route(["b#0"]) == 2 and router.route(["c#0"]) == 1
    assert router.forget("n3#1") == 0 and router.forget("n3#1") is None  # ended twice: counted once
    assert router.forget("unknown") is None
    for seq_id in ("n3#0", "n3#2", "r0#0"):
        router.forget(seq_id)
    assert router.loads == [0, 3, 2] and router.route(["d#0"]) == 0
    assert router.routed == [5, 3, 2]


def test_a_prompt_goes_where_most_of_it_went_unless_that_rank_runs_far_more():
    router = SequenceRouter(2, slack=2, capacity=8)
    history = [b"h1", b"h2", b"h3", b"h4"]  # page keys chain: a conversation's turns extend the last turn's keys
    assert router.route(["turn1#0"], history[:3]) == 0
    assert router.route(["other#0"], [b"x1"]) == 1  # nothing of it anywhere: the least loaded, in turn
    assert router.route(["busy#0"], []) == 0  # under a page: by load
    assert router.route(["turn2#0"], history) == 0  # 3 of its 4 pages are rank 0's: worth one more sequence there
    # A start most prompts share (a chat template's header) pulls nothing: one page of four is not half.
    assert router.route(["chat#0"], [b"h1", b"y2", b"y3", b"y4"]) == 1
    assert router.route(["n2#0", "n2#1"], history) == 0  # rank 1 holds one page of it, rank 0 all four
    assert router.loads == [5, 2]
    assert router.route(["turn3#0"], [*history, b"h5"]) == 1  # rank 0 runs more than 2 above the least
    assert router.routed == [5, 3]
    # A rank remembers its `capacity` most recent pages, a prompt's first pages last out.
    small = SequenceRouter(2, slack=10, capacity=2)
    small.route(["a#0"], [b"k1", b"k2", b"k3"])
    assert small._matched(0, [b"k1", b"k2", b"k3"]) == 2 and small._matched(0, [b"k2"]) == 1
    assert small.route(["b#0"], [b"k1", b"k2", b"k9"]) == 0  # rank 1 is less loaded but holds nothing
    no_cache = SequenceRouter(2, slack=10, capacity=0)  # no prefix caching: by load alone
    assert [no_cache.route([f"d{i}#0"], [b"k1"]) for i in range(3)] == [0, 1, 0]


def test_a_shared_first_page_spreads_requests_over_the_ranks():
    """Chat requests share their template's first page: at low concurrency they still spread."""
    router = SequenceRouter(4, slack=32, capacity=1000)
    ranks = [router.route([f"chat{i}#0"], [b"template", f"question{i}".encode(), f"more{i}".encode()])
             for i in range(8)]
    assert sorted(ranks) == [0, 0, 1, 1, 2, 2, 3, 3]


class _FakeRank:
    """A rank's client as `DataParallelClient` drives it: what it was sent, and what it reports next."""

    has_updates = True  # so step() reads without waiting on a pipe

    def __init__(self) -> None:
        self.added, self.finished, self.reports = [], [], []

    def add_sequences(self, sequences, grammar=None) -> None:
        self.added += [sequence.request_id for sequence in sequences]

    def finish(self, seq_ids, status) -> None:
        self.finished += seq_ids

    def step(self, timeout: float = 0.0) -> list:
        reports, self.reports = self.reports, []
        return reports


def test_every_end_a_rank_reports_or_the_frontend_causes_frees_its_load_once():
    client = DataParallelClient.__new__(DataParallelClient)
    client.clients, client.router = [_FakeRank(), _FakeRank()], SequenceRouter(2)
    for sequences in (["a#0", "a#1"], ["b#0"], ["c#0"]):
        client.add_sequences([SimpleNamespace(request_id=seq_id) for seq_id in sequences])
    assert [rank.added for rank in client.clients] == [["a#0", "a#1"], ["b#0", "c#0"]]
    stopped = SequenceDetails(status=RequestStatus.FINISHED_STOPPED)
    client.clients[0].reports = [CoreOutputs(["a#1", "a#0"], [5, 6], [0.0, 0.0], 1.0, {1: stopped}, [])]
    client.clients[1].reports = [failed([SequenceFailure("b#0", "a grammar failed")])]
    assert len(client.step()) == 2 and client.router.loads == [1, 1]
    # The frontend ends the rest (a stop string, an abort): each finish goes to its rank, an ended one nowhere.
    client.finish(["a#1", "b#0", "c#0", "a#0"], RequestStatus.FINISHED_ABORTED)
    assert [rank.finished for rank in client.clients] == [["a#1"], ["c#0"]]
    assert client.router.loads == [0, 0]


def test_stats_of_the_ranks_add_up():
    a = EngineStats(num_running=2, num_waiting=1, kv_cache_usage=0.5, num_preemptions=1, prefix_cache_queries=10,
                    prefix_cache_hits=4, iteration_tokens_buckets=(1, 2, 0), iteration_tokens_sum=30,
                    spec_decode_num_drafts=3, spec_decode_num_draft_tokens=6, spec_decode_num_accepted_tokens=2,
                    spec_decode_accepted_per_position=(2, 0), max_loras=2, running_lora_adapters=("x",),
                    waiting_lora_adapters=("y",))
    b = EngineStats(num_running=1, kv_cache_usage=0.25, iteration_tokens_buckets=(0, 1, 1), iteration_tokens_sum=9,
                    max_loras=2, running_lora_adapters=("y", "x"))
    both = combined_stats([a, b], [100, 300])
    assert (both.num_running, both.num_waiting, both.num_preemptions) == (3, 1, 1)
    assert both.kv_cache_usage == pytest.approx((0.5 * 100 + 0.25 * 300) / 400)
    assert (both.prefix_cache_queries, both.prefix_cache_hits) == (10, 4)
    assert both.iteration_tokens_buckets == (1, 3, 1) and both.iteration_tokens_sum == 39
    assert both.spec_decode_accepted_per_position == (2, 0) and both.spec_decode_num_draft_tokens == 6
    assert both.max_loras == 2 and both.running_lora_adapters == ("x", "y") and both.waiting_lora_adapters == ("y",)
    assert both.ranks == (a, b)
    assert combined_stats([EngineStats(), EngineStats()], [0, 0]) == EngineStats(ranks=(EngineStats(), EngineStats()))


def _topology(root: Path, cpus: dict[int, tuple[int, int]]) -> Path:
    """A fake /sys/devices/system/cpu: cpu -> (package, core id)."""
    for cpu, (package, core) in cpus.items():
        topology = root / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text(f"{package}\n")
        siblings = sorted(other for other, place in cpus.items() if place == (package, core))
        (topology / "thread_siblings_list").write_text(",".join(map(str, siblings)) + "\n")
    return root


def test_cpu_ranks_take_whole_physical_cores_in_package_order(tmp_path):
    # Two packages of two cores, SMT siblings numbered apart (cpu n and cpu n + 4), as Linux numbers them.
    sysfs = _topology(tmp_path, {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1), 4: (0, 0), 5: (0, 1), 6: (1, 0),
                                 7: (1, 1)})
    assert physical_cores(range(8), sysfs) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    cpu_env = {"JAX_PLATFORMS": "cpu"}
    two = placements(2, 1, cpu_env, range(8), sysfs)
    assert [p.cpus for p in two] == [{0, 1, 4, 5}, {2, 3, 6, 7}]  # a socket each
    three = placements(3, 1, cpu_env, range(8), sysfs)
    assert [sorted(p.cpus) for p in three] == [[0, 1, 4, 5], [2, 6], [3, 7]]
    assert three[0].describe() == "CPUs 0-1,4-5" and three[0].gpus is None
    assert placements(4, 1, cpu_env, [0, 4, 1], sysfs)[0].cpus is None  # 2 cores for 4 ranks: shared, unpinned
    # A CPU without a readable topology counts as a core.
    assert physical_cores([0, 9], sysfs) == [[9], [0]]


def test_gpu_ranks_take_consecutive_slices_of_the_visible_gpus(monkeypatch, tmp_path):
    monkeypatch.setattr(placement, "nvidia_gpu_visible", lambda: True)
    env = {"JAX_PLATFORMS": "cuda", "CUDA_VISIBLE_DEVICES": "4,5,GPU-abc,7"}
    assert [p.gpus for p in placements(2, 2, env)] == [("4", "5"), ("GPU-abc", "7")]
    assert [p.gpus for p in placements(4, 1, env)] == [("4",), ("5",), ("GPU-abc",), ("7",)]
    with pytest.raises(ValueError, match="needs 6 GPUs; 4 are visible"):
        placements(3, 2, env)
    for node in ("nvidia2", "nvidia0", "nvidiactl", "nvidia10", "nvidia-uvm"):
        (tmp_path / node).touch()
    assert visible_gpus({}, tmp_path) == ["0", "1", "2"]  # CUDA's ordinals, whatever the nodes' numbers
    monkeypatch.setattr(placement, "nvidia_gpu_visible", lambda: False)
    with pytest.raises(ValueError, match="NVIDIA GPUs or on a CPU"):
        placements(2, 1, {"JAX_PLATFORMS": "tpu"})


def test_data_parallel_config_is_checked():
    config = EngineConfig.from_preset(None, data_parallel_size=2)
    assert config.core_processes == 2 and EngineConfig().core_processes == 0
    assert EngineConfig.from_preset(None, engine_process=True).core_processes == 1
    with pytest.raises(ValueError, match="data_parallel_size must be >= 1"):
        EngineConfig.from_preset(None, data_parallel_size=0)
    with pytest.raises(ValueError, match="one host"):
        EngineConfig.from_preset(None, data_parallel_size=2, num_processes=2, coordinator_address="h:1")


@pytest.fixture(scope="module")
def in_process(llama_dir):
    return make_engine(llama_dir)


@pytest.fixture(scope="module")
def two_ranks(llama_dir, compile_cache):
    require_ranks(2)
    # Ranks on CPU cores of their own start at once, with a compilation cache too.
    engine = make_engine(llama_dir, data_parallel_size=2, async_scheduling=True,
                         compilation_cache_dir=str(compile_cache))
    # Any rank may take a request whose prefix it holds, whatever the loads (the default slack is 1 here,
    # and the loads at a request's arrival depend on the ranks' timing).
    engine._core.router.slack = 8
    yield engine
    engine.shutdown()


def test_two_ranks_give_the_in_process_outputs(in_process, two_ranks):
    clients = two_ranks._core.clients
    assert two_ranks.core is None and len({client._process.pid for client in clients} | {os.getpid()}) == 3
    assert clients[1].started_at < clients[0].ready_at
    expected_cpus = [rank.cpus for rank in placements(2, 1)]
    for client, cpus in zip(clients, expected_cpus, strict=True):
        # Every thread of the rank's process (XLA's pools, numpy's, the sender) on the rank's cores.
        threads = list(Path(f"/proc/{client._process.pid}/task").iterdir())
        assert len(threads) > 2
        assert {frozenset(os.sched_getaffinity(int(thread.name))) for thread in threads} == {
            frozenset(cpus or os.sched_getaffinity(0))}
    requests, arrivals = workload(in_process)
    expected = run(in_process, requests, arrivals)
    before = list(two_ranks._core.router.routed)
    got = run(two_ranks, requests, arrivals)
    assert_same(expected, got)
    assert got["stop-string"].outputs[0].finish_reason == "stop"
    # The second request of a shared prefix went to the rank that had the first: its pages were there.
    assert got["shared-b"].num_cached_tokens == expected["shared-b"].num_cached_tokens > 0
    routed = [after - start for after, start in zip(two_ranks._core.router.routed, before, strict=True)]
    assert sum(routed) == sum(params.n for _, params in requests.values()) and min(routed) > 0
    assert two_ranks._core.router.loads == [0, 0]


def test_each_rank_drafts_with_a_draft_model_of_its_own(in_process, llama_dir, compile_cache):
    """--speculative-config's draft model on two ranks: each rank loads it on its own devices beside its
    target; the outputs are the in-process engine's, and the target as its own draft has its drafts accepted
    (the ranks' draft policies run rounds until they have timed them)."""
    require_ranks(2)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    requests = {f"g{i}": (prompt, params) for i, prompt in enumerate(make_prompts(6))}
    arrivals = dict.fromkeys(requests, 0)
    expected = run(in_process, requests, arrivals)
    engine = make_engine(llama_dir, data_parallel_size=2, compilation_cache_dir=str(compile_cache),
                         speculative_config={"model": str(llama_dir), "num_speculative_tokens": 2})
    try:
        assert_same(expected, run(engine, requests, arrivals))
        stats = engine.stats()
        assert stats.spec_decode_num_draft_tokens > 0
        assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    finally:
        engine.shutdown()


def test_aborts_reach_the_rank_that_holds_the_request(in_process, two_ranks):
    assert_aborts_leave_the_others_unchanged(in_process, two_ranks)
    assert two_ranks._core.router.loads == [0, 0]
    # Every rank's pages are free again once it has heard: a request on each, then nothing left anywhere.
    run_short_requests(two_ranks, 2)
    stats = two_ranks.stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0.0
    assert [client.stats().iteration_tokens_sum > 0 for client in two_ranks._core.clients] == [True, True]


def test_each_rank_traces_its_own_steps_and_a_refusal_on_one_stops_the_others(two_ranks, tmp_path):
    """A profile writes each rank's trace in `rank<i>`; a rank that refuses to start (it traces already)
    fails the start, and the ranks started before it stop, so a later profile starts everywhere."""
    clients = two_ranks._core.clients
    clients[1].start_profile(str(tmp_path / "rank1-alone"))
    with pytest.raises(RuntimeError, match=r"(?i)already"):
        two_ranks.start_profile(str(tmp_path / "refused"))
    assert two_ranks.profile_dir is None
    clients[1].stop_profile()
    two_ranks.start_profile(str(tmp_path / "trace"))  # rank 0 was stopped: it starts again
    run_short_requests(two_ranks, 2)  # a request on each rank
    assert two_ranks.stop_profile() == str(tmp_path / "trace")
    assert [traced_jit_calls(str(tmp_path / "trace" / f"rank{rank}"))["step"] >= 1 for rank in (0, 1)] == [True] * 2


def test_a_dead_rank_fails_live_requests_and_the_engine(llama_dir, compile_cache, monkeypatch):
    # Ranks that share the host's cores (as GPU ranks do) with a compilation cache: rank 1 starts once rank 0
    # is ready, and reads its compiles.
    monkeypatch.setattr(data_parallel, "placements", lambda num_ranks, _: [RankPlacement(r, num_ranks)
                                                                           for r in range(num_ranks)])
    engine = make_engine(llama_dir, data_parallel_size=2, compilation_cache_dir=str(compile_cache))
    clients = engine._core.clients
    assert clients[1].started_at >= clients[0].ready_at
    assert [os.sched_getaffinity(client._process.pid) for client in clients] == [os.sched_getaffinity(0)] * 2
    async_engine = AsyncEngine(engine)

    async def scenario() -> None:
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        streams = [async_engine.generate(make_prompts(1)[0], params, request_id=f"doomed-{i}") for i in range(2)]
        for stream in streams:
            assert (await anext(stream)).outputs[0].token_ids  # both run, one on each rank
        os.kill(async_engine.engine._core.clients[1]._process.pid, signal.SIGKILL)
        for stream in streams:
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass
        assert not async_engine.is_running

    try:
        asyncio.run(scenario())
    finally:
        async_engine.shutdown()
    assert not any(client._process.is_alive() for client in clients)  # the surviving rank stopped too


def test_a_rank_that_cannot_start_stops_them_all(tmp_path):
    require_ranks(2)
    before = set(multiprocessing.active_children())  # other tests' engines
    with pytest.raises(CoreProcessDied, match=r"did not start.*has no config\.json"):
        make_engine(tmp_path, data_parallel_size=2)  # no model there
    assert set(multiprocessing.active_children()) <= before
