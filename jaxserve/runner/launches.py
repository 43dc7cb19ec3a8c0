"""What a compiled GPU step launches, read from XLA's thunk sequence and optimized HLO, with no device.

A GPU step's cost beyond the model is mostly per launch: each kernel or library call the host issues, and
each argument it passes. XLA's command buffers (CUDA graphs, `--xla_gpu_enable_command_buffer`) record a
run of kernels once and replay it as one launch; XLA forms them on its thunk sequence, after the HLO
passes, so they show in the thunks XLA dumps (`*.thunk_sequence_after_thunk_passes.txt`), not in the HLO.
What runs between command buffers is issued by the host one by one: a `kConditional` or `kWhile` there
copies its predicate to the host and waits for it (the host cannot queue the rest of the step meanwhile),
but for a loop whose trip count XLA knows (`known_trip_count`, a `lax.fori_loop` with static bounds): the
host issues its body that many times without reading anything back.
These counts, per bucket, are the proxies a machine without a GPU can watch (`jaxserve compile`).
"""

import glob
import re
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_THUNK = re.compile(r"^( *)\d+: (k\w+)")
_KERNEL_KINDS = frozenset({"kKernel", "kCustomKernel", "kGemm", "kCublasLtMatmul", "kCustomCall", "kCudnn",
                           "kTriangularSolve", "kFft", "kConvolution", "kNcclAllReduceStart", "kNcclAllGatherStart",
                           "kNcclReduceScatterStart", "kNcclAllToAllStart", "kNcclCollectivePermuteStart",
                           "kAllReduceStart", "kAllGatherStart", "kReduceScatterStart"})
_HOST_SYNCS = frozenset({"kConditional", "kWhile"})
_BODY_INDENT = 4  # a top-level loop's body thunks, in the dump


@dataclass(frozen=True)
class StepLaunches:
    """One compiled step's launches."""

    num_arguments: int  # the entry computation's parameters: buffers passed on every dispatch
    host_ops: dict[str, int]  # the step's top-level thunks by kind: what the host issues, one by one
    num_kernels: int  # kernels and library calls anywhere in the step (a loop body or branch counted once)
    kernels_in_graphs: int  # of which recorded in command buffers
    num_graphs: int  # command buffers, nested ones included
    control_flow: dict[str, int] = field(default_factory=dict)  # conditionals and while loops, anywhere
    counted_loops: int = 0  # top-level loops of known trip count: issued from the host, no predicate read
    # Conditionals and loops outside command buffers at the top of a top-level loop's body: the host reads
    # each one's predicate once per iteration (a multi-step decode's: once per decode step).
    loop_body_syncs: int = 0

    @property
    def num_host_ops(self) -> int:
        return sum(self.host_ops.values())

    @property
    def host_syncs(self) -> int:
        """Top-level conditionals and loops but the counted ones, and those at the top of a top-level loop's
        body: each reads its predicate on the host, a stall per step (per iteration, in a loop's body).
        Control flow nested in a branch syncs too when the branch runs: not counted."""
        top_level = sum(n for kind, n in self.host_ops.items() if kind in _HOST_SYNCS) - self.counted_loops
        return top_level + self.loop_body_syncs

    @property
    def graph_share(self) -> float:
        return self.kernels_in_graphs / self.num_kernels if self.num_kernels else 0.0


def thunk_launches(thunk_text: str, num_arguments: int, counted_loops: int = 0) -> StepLaunches:
    """The launches in XLA's thunk sequence dump (`*.thunk_sequence_after_thunk_passes.txt`), given the
    entry computation's parameters and loops of known trip count (read from the optimized HLO)."""
    host_ops: Counter = Counter()
    control: Counter = Counter()
    num_kernels = in_graphs = num_graphs = body_syncs = 0
    graph_depths: list[int] = []  # indents of the command buffers enclosing the current line
    in_top_loop = False  # the lines since a top-level kWhile (its condition and body)
    for line in thunk_text.splitlines():
        match = _THUNK.match(line)
        if match is None:
            continue
        indent, kind = len(match.group(1)), match.group(2)
        while graph_depths and indent <= graph_depths[-1]:
            graph_depths.pop()
        if indent == 0:
            host_ops[kind] += 1
            in_top_loop = kind == "kWhile"
        elif in_top_loop and indent == _BODY_INDENT and kind in _HOST_SYNCS:
            body_syncs += 1
        if kind == "kCommandBuffer":
            num_graphs += 1
            graph_depths.append(indent)
        elif kind in _HOST_SYNCS:
            control[kind] += 1
        elif kind in _KERNEL_KINDS or kind == "kCopy":
            num_kernels += 1
            in_graphs += bool(graph_depths)
    return StepLaunches(num_arguments, dict(host_ops.most_common()), num_kernels, in_graphs, num_graphs,
                        dict(control), counted_loops, body_syncs)


def compile_with_launches(compile_fn: Callable[[dict[str, Any]], Any]) -> tuple[Any, StepLaunches | None]:
    """Runs `compile_fn(compiler_options)` with XLA dumping into a temporary directory, and reads the
    compiled step's launches from the dump: (compiled, launches), launches None off GPUs (no thunks)."""
    with tempfile.TemporaryDirectory(prefix="jaxserve-thunks-") as dump_dir:
        compiled = compile_fn({"xla_dump_to": dump_dir})
        # Without command buffers to form (--enforce-eager), XLA runs no thunk passes: the sequence as emitted.
        files = (glob.glob(f"{dump_dir}/*thunk_sequence_after_thunk_passes.txt")
                 or glob.glob(f"{dump_dir}/*thunk_sequence.txt"))
        if not files:
            return compiled, None
        with open(max(files)) as f:
            thunks = f.read()
    hlo_text = compiled.as_text()
    return compiled, thunk_launches(thunks, entry_arguments(hlo_text), counted_entry_loops(hlo_text))


def _entry_computation(hlo_text: str) -> str:
    start = hlo_text.find("\nENTRY ")
    if start < 0:
        raise ValueError("no ENTRY computation in the HLO text")
    return hlo_text[start : hlo_text.find("\n}", start)]


def entry_arguments(hlo_text: str) -> int:
    """The entry computation's parameters in optimized HLO text."""
    return _entry_computation(hlo_text).count(" parameter(")


def counted_entry_loops(hlo_text: str) -> int:
    """The entry computation's while loops whose trip count XLA knows, in optimized HLO text."""
    return sum(1 for line in _entry_computation(hlo_text).splitlines()
               if " while(" in line and '"known_trip_count"' in line)
