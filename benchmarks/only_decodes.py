"""What the scheduler pays each step to ask whether k-step decodes (or drafts) may run: `only_decodes()` with
N running plain decodes at k = 8 (the `gpu` preset's), median microseconds over many calls.

    python benchmarks/only_decodes.py --seqs 256   # from each tree with PYTHONPATH on it, alternating
"""

import argparse
import statistics
import time

from jaxserve.engine.kv_cache_manager import KVCacheManager
from jaxserve.engine.request import Request
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.step_io import StepOutput
from jaxserve.sampling_params import SamplingParams


def measure(num_seqs: int, num_calls: int) -> float:
    """Median microseconds of `only_decodes()` once every request decodes."""
    scheduler = Scheduler(KVCacheManager(num_seqs * 40, 16), max_num_seqs=num_seqs, max_num_batched_tokens=8192,
                          num_scheduler_steps=8)
    params = SamplingParams(max_tokens=500, ignore_eos=True)
    for i in range(num_seqs):
        scheduler.add_request(Request(str(i), list(range(1000 * i, 1000 * i + 16)), params, (2,), 4096, 0))
    out = scheduler.schedule()  # the prompts
    scheduler.update(out, StepOutput(out.request_ids, [5] * num_seqs, [0.0] * num_seqs))
    assert scheduler.only_decodes()
    times = []
    for _ in range(num_calls):
        start = time.perf_counter()
        scheduler.only_decodes()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    print(f"only_decodes, {args.seqs} decodes, k=8: {measure(args.seqs, args.calls):.1f} us")


if __name__ == "__main__":
    main()
