"""What one streamed chunk costs the server's front end: building a completions and a chat chunk (one token of
text, every other field at its default) and serializing it as a server-sent event, as `sse` does per token.

    python benchmarks/stream_chunk.py                         # this checkout
    PYTHONPATH=/tmp/before python benchmarks/stream_chunk.py  # another commit's, from a worktree
"""

import argparse
import time

from jaxserve.api.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
)
from jaxserve.api.streaming import sse_data


def completion_chunk() -> str:
    return sse_data(CompletionResponse(id="cmpl-0", model="m", choices=[CompletionChoice(index=0, text=" word")]))


def chat_chunk() -> str:
    return sse_data(ChatCompletionChunk(id="chatcmpl-0", created=0, model="m",
                                        choices=[ChatChunkChoice(index=0, delta=DeltaMessage(content=" word"))]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    for name, make in (("completion", completion_chunk), ("chat", chat_chunk)):
        per_chunk = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            for _ in range(args.chunks):
                make()
            per_chunk.append((time.perf_counter() - start) / args.chunks * 1e6)
        print(f"{name}: {min(per_chunk):.2f} us a chunk (best of {args.rounds}), {len(make())} bytes")


if __name__ == "__main__":
    main()
