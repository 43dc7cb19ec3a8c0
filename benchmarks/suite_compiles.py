"""Where the suite's XLA compiles go, from a run with JAXSERVE_TEST_COMPILE_LOG set (tests/compile_log.py):
compile seconds and persistent-cache hits by test file and by program, and any program compiled more than
once in the run (the suite's shared cache should load it the second time).

    JAXSERVE_TEST_COMPILE_LOG=/tmp/compiles.jsonl pytest -n 2 --dist loadfile tests
    python benchmarks/suite_compiles.py /tmp/compiles.jsonl --top 20
"""

import argparse
import collections
import json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log")
    parser.add_argument("--top", type=int, default=15, help="rows per table")
    args = parser.parse_args()
    with open(args.log) as log:
        records = [json.loads(line) for line in log]
    compiles = [r for r in records if r["kind"] == "compile"]
    hits = len(records) - len(compiles)
    print(f"{len(compiles)} compiles, {sum(r['seconds'] for r in compiles):.0f} s; {hits} persistent-cache hits")
    for title, group in (("test file", lambda r: r["test"].split("::")[0]), ("program", lambda r: r["program"])):
        seconds, counts, loads = collections.Counter(), collections.Counter(), collections.Counter()
        for r in records:
            if r["kind"] == "compile":
                seconds[group(r)] += r["seconds"]
                counts[group(r)] += 1
            else:
                loads[group(r)] += 1
        print(f"\n| {title} | compile s | compiles | cache hits |\n|---|---|---|---|")
        for name, total in seconds.most_common(args.top):
            print(f"| `{name}` | {total:.1f} | {counts[name]} | {loads[name]} |")
    again = collections.Counter(r["key"] for r in compiles if r["key"])
    twice = {key: n for key, n in again.items() if n > 1}
    print(f"\nprograms compiled more than once: {len(twice)}")
    for key, n in sorted(twice.items(), key=lambda item: -item[1])[: args.top]:
        tests = sorted({r["test"] for r in compiles if r["key"] == key})
        print(f"  {n}x {key}: {', '.join(tests[:3])}")


if __name__ == "__main__":
    main()
