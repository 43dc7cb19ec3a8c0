"""The engine thread's cost of handing one step's outputs to the event loop, per request or batched.

A thread stands in for the engine thread and hands an item to each of N `asyncio.Queue`s on a running
loop, either with one `loop.call_soon_threadsafe` per queue (each writes to the loop's self-pipe) or
with one call carrying the whole list (what `AsyncEngine._deliver` does). Medians of the thread's time
per step, the two modes alternating.

    python benchmarks/output_delivery.py --streams 256
"""

import argparse
import asyncio
import statistics
import threading
import time


def put_all(items: list[tuple[asyncio.Queue, int]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


async def measure(num_streams: int, steps: int, rounds: int) -> dict[str, list[float]]:
    loop = asyncio.get_running_loop()
    queues: list[asyncio.Queue] = [asyncio.Queue() for _ in range(num_streams)]
    results: dict[str, list[float]] = {"per request": [], "batched": []}

    def engine_thread() -> None:
        for _ in range(rounds):
            for mode, times in results.items():
                samples = []
                for _ in range(steps):
                    start = time.perf_counter()
                    if mode == "batched":
                        loop.call_soon_threadsafe(put_all, [(queue, 1) for queue in queues])
                    else:
                        for queue in queues:
                            loop.call_soon_threadsafe(queue.put_nowait, 1)
                    samples.append(time.perf_counter() - start)
                    time.sleep(0.002)  # the step's device time: the loop drains meanwhile
                times.append(statistics.median(samples) * 1e3)

    async def drain(queue: asyncio.Queue) -> None:
        while True:
            await queue.get()

    consumers = [asyncio.create_task(drain(queue)) for queue in queues]
    thread = threading.Thread(target=engine_thread)
    thread.start()
    while thread.is_alive():
        await asyncio.sleep(0.01)
    for consumer in consumers:
        consumer.cancel()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    results = asyncio.run(measure(args.streams, args.steps, args.rounds))
    for mode, times in results.items():
        print(f"{mode}: " + ", ".join(f"{t:.3f}" for t in times) + " ms of engine-thread time per step")


if __name__ == "__main__":
    main()
