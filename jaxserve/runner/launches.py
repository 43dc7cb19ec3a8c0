"""What a compiled step launches, read from its optimized HLO (`Compiled.as_text()`), with no device.

A GPU step's cost beyond the model is mostly per launch: each kernel or library call the host issues, and
each argument it passes. XLA's command buffers (CUDA graphs: `--xla_gpu_enable_command_buffer`) replay a
recorded sequence of launches as one; what they cannot hold (control flow XLA does not capture, some
custom calls) runs between them and splits the step into several graphs. These counts, per bucket, are the
proxies a machine without a GPU can watch (`jaxserve compile`).

Counted as launches: every instruction of an executed computation (the entry, while loop bodies and
conditions, conditional branches, command buffers) except those that launch nothing (parameters,
constants, tuples, bitcasts, calls, control flow itself, the `-done` halves of async pairs).
"""

import re
from collections import Counter
from dataclasses import dataclass, field

# Opcodes that launch no kernel of their own.
_NO_LAUNCH = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "call", "while", "conditional",
    "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency", "copy-done", "all-reduce-done",
    "all-gather-done", "collective-permute-done", "send-done", "recv-done", "async-done", "domain",
    "get-dimension-size", "iota",
})
_COMPUTATION = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = .*? ([a-z][a-z0-9\-]*)\(")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_FUSION_KIND = re.compile(r"kind=(k\w+)")
_BACKEND_KIND = re.compile(r'"kind":"([^"]+)"')
_CALLED = re.compile(r"(?:to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


@dataclass(frozen=True)
class StepLaunches:
    """One compiled step's launches."""

    num_arguments: int  # the entry computation's parameters: buffers passed on every dispatch
    num_launches: int  # kernels and library calls per run (a loop body counted once)
    by_kind: dict[str, int]  # fusions by kind, library calls by target, other ops by opcode
    num_command_buffers: int  # XLA command buffers (CUDA graphs) the step runs
    in_command_buffers: int  # launches recorded inside them
    outside_command_buffers: dict[str, int] = field(default_factory=dict)  # launches left out, by kind
    control_flow: dict[str, int] = field(default_factory=dict)  # while loops and conditionals executed

    @property
    def command_buffer_share(self) -> float:
        return self.in_command_buffers / self.num_launches if self.num_launches else 0.0


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], str | None]:
    """name -> instruction lines, and the entry computation's name."""
    computations: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        if current is None:
            match = _COMPUTATION.match(line)
            if match:
                current = match.group(2)
                computations[current] = []
                if match.group(1):
                    entry = current
            continue
        if line.startswith("}"):
            current = None
        else:
            computations[current].append(line)
    return computations, entry


def _kind(line: str, opcode: str) -> str:
    if opcode == "custom-call":
        target = _TARGET.search(line)
        return f"custom-call:{target.group(1) if target else '?'}"
    if opcode == "fusion":
        backend = _BACKEND_KIND.search(line)
        kind = _FUSION_KIND.search(line)
        return f"fusion:{backend.group(1) if backend else kind.group(1) if kind else '?'}"
    return opcode


def step_launches(hlo_text: str) -> StepLaunches:
    """The launches of a compiled step, from its optimized HLO text."""
    computations, entry = _computations(hlo_text)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    by_kind: Counter = Counter()
    outside: Counter = Counter()
    control: Counter = Counter()
    num_buffers = in_buffers = 0
    seen: set[str] = set()

    def walk(name: str, in_buffer: bool) -> None:
        nonlocal num_buffers, in_buffers
        if name in seen or name not in computations:
            return
        seen.add(name)
        for line in computations[name]:
            match = _INSTRUCTION.match(line)
            if match is None:
                continue
            opcode = match.group(1)
            if opcode in ("while", "conditional"):
                control[opcode] += 1
                called = _CALLED.findall(line)
                branches = _BRANCHES.search(line)
                called += [b.strip().lstrip("%") for b in branches.group(1).split(",")] if branches else []
                for callee in called:
                    walk(callee, in_buffer)
                continue
            if opcode == "call":
                for callee in _CALLED.findall(line):
                    is_buffer = callee.startswith("command_buffer")
                    num_buffers += is_buffer and not in_buffer
                    walk(callee, in_buffer or is_buffer)
                continue
            if opcode in _NO_LAUNCH:
                continue
            kind = _kind(line, opcode)
            by_kind[kind] += 1
            if in_buffer:
                in_buffers += 1
            else:
                outside[kind] += 1

    walk(entry, False)
    num_arguments = sum(1 for line in computations[entry] if " parameter(" in line)
    return StepLaunches(num_arguments, sum(by_kind.values()), dict(by_kind.most_common()), num_buffers, in_buffers,
                        dict(outside.most_common()), dict(control))
