"""The decode-step profile (`jaxserve bench offline --profile`) on this machine's backend, a tiny model."""

from jaxserve.bench.step_profile import PHASES, StepProfiler, device_ops, print_profiles
from jaxserve.device import local_facts
from tests.engine.helpers import make_engine


def test_a_decode_step_is_split_into_its_phases(llama_dir, capsys):
    facts = local_facts()  # a CPU has no bandwidth figure here; a GPU with a data sheet has
    has_roofline = facts.memory_bandwidth is not None and facts.peak_flops_for("float32") is not None
    for async_scheduling in (False, True):
        engine = make_engine(llama_dir, async_scheduling=async_scheduling)
        profiler = StepProfiler(engine)
        profiles = [profiler.profile(concurrency, input_len=8, num_steps=6, trace_steps=2) for concurrency in (1, 4)]
        for profile in profiles:
            m = profile.median_ms
            assert all(m[name] >= 0 for name in (*PHASES, "gap")), m
            assert m["device"] > 0 and m["dispatch"] > 0 and m["build"] > 0 and m["schedule"] > 0, m
            assert m["host"] <= m["step"] + 1e-6 and m["step"] > 0
            assert profile.device == facts.name and (profile.roofline_ms is not None) == has_roofline
        assert not engine.has_unfinished_requests() and not engine.core.has_unfinished(), "the profile cleans up"
        print_profiles(profiles)
        printed = capsys.readouterr().out
        assert "per decode step" in printed and ("no memory bandwidth" in printed) != has_roofline


def test_a_multi_step_decode_is_profiled_per_decode_step(llama_dir):
    """With --num-scheduler-steps 4 each engine step runs 4 decode steps: the figures are per decode step,
    so a step's time is about a quarter of the engine step's."""
    engine = make_engine(llama_dir, num_scheduler_steps=4)
    profiler = StepProfiler(engine)
    decode_steps = []
    launch = engine.runner.launch

    def counting(plan):
        decode_steps.append(plan.num_steps)
        return launch(plan)

    engine.runner.launch = counting
    profile = profiler.profile(2, input_len=8, num_steps=5, trace_steps=2)
    assert engine.runner.num_multi_steps > 0 and 4 in decode_steps
    m = profile.median_ms
    assert m["device"] > 0 and m["host"] <= m["step"] + 1e-6
    assert not engine.has_unfinished_requests() and not engine.core.has_unfinished()


def test_device_ops_are_read_from_a_trace():
    trace = {"traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
        *[{"ph": "X", "pid": 1, "name": "gemm", "dur": 200.0} for _ in range(4)],
        *[{"ph": "X", "pid": 1, "name": "fusion.1", "dur": 10.0} for _ in range(6)],
        {"ph": "X", "pid": 2, "name": "PjitFunction", "dur": 5000.0},
    ]}
    per_step, top = device_ops(trace, num_steps=2)
    assert per_step == 5.0 and top == [("gemm", 0.4), ("fusion.1", 0.03)]
    assert device_ops({"traceEvents": []}, 1) == (None, [])
