"""Time of `DraftPolicy.choose` (8 requests with 4 drafts each, 7 timed buckets), for one or more versions of
`draft_policy.py` side by side in one run, alternating:
`python -m benchmarks.draft_policy_cost OLD.py jaxserve/engine/draft_policy.py`
(an old version: `git show REV:jaxserve/engine/draft_policy.py > OLD.py`)."""

import importlib.util
import sys
import timeit


def _load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(paths: list[str], rounds: int = 2, calls: int = 20_000) -> None:
    for _ in range(rounds):
        for i, path in enumerate(paths):
            policy = _load(path, f"policy{i}").DraftPolicy((1, 2, 4, 8, 16, 32, 64), max_rows=64)
            for rows, seconds in ((1, .006), (2, .0062), (4, .0065), (8, .007), (16, .009), (32, .014), (64, .025)):
                policy.observe_step(rows, seconds)
                policy.observe_step(rows, seconds)
            for _ in range(40):
                policy.observe_first_draft(True)
            proposals = [[1, 2, 3, 4]] * 8
            choose = policy.choose
            seconds = timeit.timeit(lambda choose=choose, proposals=proposals: choose(proposals), number=calls) / calls
            print(f"{path}: {seconds * 1e6:.2f} us a choice")


if __name__ == "__main__":
    main(sys.argv[1:])
