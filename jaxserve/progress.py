"""Progress of long start-up loops (weights, bucket compilation): a bar on a terminal, log lines elsewhere.

A tqdm bar redraws with `\\r`; written to a log file or a container's log it becomes kilobytes of one
unreadable line. So the bar is only drawn when stderr is a terminal; otherwise a line is logged at most
every `interval_s` seconds. The caller logs the final summary (count and seconds) either way.
"""

import logging
import sys
import time
from collections.abc import Iterable, Iterator, Sized
from typing import TypeVar

T = TypeVar("T")

LOG_INTERVAL_S = 5.0


def progress(
    items: Iterable[T],
    desc: str,
    logger: logging.Logger,
    *,
    unit: str = "it",
    interval_s: float = LOG_INTERVAL_S,
) -> Iterator[T]:
    """Yields `items`, reporting how far it got: a tqdm bar on a terminal, else `desc: i/n unit (s)` lines."""
    if sys.stderr.isatty():
        from tqdm.auto import tqdm

        yield from tqdm(items, desc=desc, unit=f" {unit}", leave=False)
        return
    total = len(items) if isinstance(items, Sized) else None
    of_total = f"/{total}" if total is not None else ""
    start = last = time.monotonic()
    for done, item in enumerate(items, 1):
        yield item
        now = time.monotonic()
        if now - last >= interval_s and done != total:  # the last one is the caller's summary line
            logger.info("%s: %d%s %s (%.0fs)", desc, done, of_total, unit, now - start)
            last = now
