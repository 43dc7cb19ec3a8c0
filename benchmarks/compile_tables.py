"""Markdown tables from `jaxserve compile --json` reports, as docs/benchmarks.md shows them.

    python benchmarks/compile_tables.py docs/compile/gpt2-h100.json docs/compile/llama-3-8b-h100.json

Per report: every decode bucket, and the mixed buckets with the fewest and the most requests per token
bucket; then the totals (compile time, largest temp allocation, KV budget).
"""

import json
import sys
from pathlib import Path

MIB, GIB = 2**20, 2**30


def rows_to_show(buckets: list[dict]) -> list[dict]:
    decode = [b for b in buckets if b["decode_only"]]
    mixed: dict[int, list[dict]] = {}
    for b in buckets:
        if not b["decode_only"]:
            mixed.setdefault(b["num_tokens"], []).append(b)
    ends = [row for rows in mixed.values() for row in (rows[0], rows[-1])]
    return decode + sorted({(r["num_tokens"], r["num_reqs"]): r for r in ends}.values(),
                           key=lambda r: (r["num_tokens"], r["num_reqs"]))


def table(report: dict) -> str:
    lines = [
        f"**{report['model']}** on {report['device']}, {report['dtype']}, attention `{report['attention']}`, "
        f"max_model_len {report['max_model_len']}, roofline at {report['context_len']} keys per request",
        "",
        "| tokens x reqs | kind | compile s | temp MiB | XLA GFLOP (CPU lowering) | GFLOP | GB | predicted ms "
        "| bound | tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows_to_show(report["buckets"]):
        tok_s = r["num_tokens"] / r["predicted_seconds"]
        xla = "-" if r["xla_flops"] is None else f"{r['xla_flops'] / 1e9:,.1f}"
        lines.append(
            f"| {r['num_tokens']} x {r['num_reqs']} | {'decode' if r['decode_only'] else 'mixed'} "
            f"| {r['compile_seconds']:.1f} | {r['temp_bytes'] / MIB:,.0f} | {xla} | {r['flops'] / 1e9:,.1f} "
            f"| {r['bytes'] / 1e9:,.2f} | {r['predicted_seconds'] * 1e3:,.3f} | {r['bound']} | {tok_s:,.0f} |"
        )
    budget = report["kv_budget"]
    lines += [
        "",
        f"{len(report['buckets'])} buckets, {report['compile_seconds']:.0f} s of compile time "
        f"({report['wall_seconds']:.0f} s wall including the budget's two compiles and XLA's CPU cost analysis); "
        f"weights {report['weights_bytes'] / GIB:.2f} GiB, penalty tables {report['state_bytes'] / MIB:.0f} MiB, "
        f"largest temp allocation {report['max_temp_bytes'] / MIB:,.0f} MiB. KV budget at "
        f"--gpu-memory-utilization {report['gpu_memory_utilization']}: {report['kv_budget_bytes'] / GIB:.2f} GiB "
        f"of {budget['device_memory_bytes'] / GIB:.1f} GiB = {report['num_kv_pages']:,} pages of "
        f"{report['page_size']} tokens ({report['num_kv_pages'] * report['page_size']:,} tokens).",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print("\n\n".join(table(json.loads(Path(p).read_text())) for p in sys.argv[1:]))
