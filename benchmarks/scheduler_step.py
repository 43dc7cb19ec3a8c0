"""The scheduler's own share of a decode step: `schedule()` and `update()` with N running requests all
decoding (pure Python, no model), medians over many steps, with and without prefix caching.

    python benchmarks/scheduler_step.py --seqs 256 --steps 300

To compare two trees side by side, run it from each with `PYTHONPATH` on that tree, alternating.
"""

import argparse
import statistics
import time

from jaxserve.engine.kv_cache_manager import KVCacheManager
from jaxserve.engine.request import Request
from jaxserve.engine.scheduler import Scheduler
from jaxserve.sampling_params import SamplingParams

try:
    from jaxserve.engine.step_io import StepOutput
except ImportError:  # a tree from before engine/step_io.py
    from jaxserve.engine.scheduler import StepOutput


def measure(num_seqs: int, num_steps: int, caching: bool) -> tuple[float, float]:
    """(schedule ms, update ms), medians."""
    kv = KVCacheManager(num_seqs * 40, 16, enable_prefix_caching=caching)
    scheduler = Scheduler(kv, max_num_seqs=num_seqs, max_num_batched_tokens=8192)
    params = SamplingParams(max_tokens=num_steps + 200, ignore_eos=True)
    for i in range(num_seqs):
        scheduler.add_request(Request(str(i), list(range(1000 * i, 1000 * i + 16)), params, (2,), 4096, 0))
    out = scheduler.schedule()  # the prompts
    scheduler.update(out, StepOutput(out.request_ids, [5] * num_seqs, [0.0] * num_seqs))
    schedule_s, update_s = [], []
    for _ in range(num_steps):
        start = time.perf_counter()
        out = scheduler.schedule()
        planned = time.perf_counter()
        scheduler.update(out, StepOutput(out.request_ids, [5] * num_seqs, [0.0] * num_seqs))
        schedule_s.append(planned - start)
        update_s.append(time.perf_counter() - planned)
    return statistics.median(schedule_s) * 1e3, statistics.median(update_s) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    for caching in (False, True):
        schedule_ms, update_ms = measure(args.seqs, args.steps, caching)
        print(f"{args.seqs} seqs, prefix caching {'on' if caching else 'off'}: schedule {schedule_ms:.3f} ms, "
              f"update {update_ms:.3f} ms")


if __name__ == "__main__":
    main()
