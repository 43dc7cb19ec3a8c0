"""Multi-host serving: one model split over the devices of several processes (`jax.distributed`).

Every process loads its shards of the weights, builds the same `ModelRunner` over the global mesh and
compiles and warms up the same buckets in the same order. Process 0 (the leader) then runs the HTTP server,
the scheduler and the engine; before each piece of device work it sends the work, a plain record with the
step's numpy inputs, to every other process (the followers) over a socket, and each follower runs the same
jitted computation on the same inputs, so the collectives inside (the all-reduces of tensor parallelism)
meet. Only the leader reads results. The leader's runner sends through the `Broadcast` it is given
(`Leader.send`); the followers' loop lives beside the engine core (`jaxserve.engine.follower`).

The channel: the leader listens on the coordinator's host at the coordinator's port + 1
(`multiprocessing.connection`, authenticated with `JAXSERVE_MULTIHOST_KEY`; like jax.distributed's
coordinator, it is meant for a trusted network). Threads: the leader's engine thread sends; one watcher
thread per follower waits for its connection to close. A follower runs the work in its main thread.

Stopping: when the leader stops it sends `Stop` and the followers exit. When a follower's connection drops
(the process died), the leader logs it and exits within `LOST_PEER_EXIT_S`: its next collective could never
complete. When the leader's connection drops, a follower exits.
"""

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener

import numpy as np

from jaxserve.config import ParallelConfig
from jaxserve.runner.buckets import Bucket
from jaxserve.runner.step_batch import StepBatch

logger = logging.getLogger(__name__)

LOST_PEER_EXIT_S = 10.0  # a leader whose follower vanished stops gracefully within this, else exits hard
CONNECT_TIMEOUT_S = 300.0  # followers may start before the leader listens (its model loads first)


# The work a follower replays, in the leader's order.
@dataclass(frozen=True)
class Step:
    bucket: Bucket
    batch: StepBatch  # of numpy arrays
    greedy: bool = False  # run by the bucket's greedy variant
    decode_steps: np.ndarray | None = None  # i32[R]: a multi-step decode's steps per row


@dataclass(frozen=True)
class LoadSeenTokens:
    slot: int
    token_ids: list[int]
    num_prompt_tokens: int


@dataclass(frozen=True)
class Stop:
    pass


DeviceWork = Step | LoadSeenTokens | Stop
Broadcast = Callable[[DeviceWork], None]  # how a leader's runner sends its device work


def initialize(config: ParallelConfig) -> None:
    """Joins the jax.distributed job (once); call before anything starts a jax backend."""
    import jax

    if jax.distributed.is_initialized():
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices' collectives across processes
    jax.distributed.initialize(config.coordinator_address, config.num_processes, config.process_id)
    logger.info("process %d of %d joined %s: %d devices, %d local", config.process_id, config.num_processes,
                config.coordinator_address, jax.device_count(), jax.local_device_count())


def _authkey() -> bytes:
    return os.environ.get("JAXSERVE_MULTIHOST_KEY", "jaxserve-multihost").encode()


class Leader:
    """Process 0's side: listens from the start, accepts every follower once its own warm-up is done
    (`accept_followers`), then sends each piece of device work to all of them (`send`)."""

    def __init__(self, config: ParallelConfig) -> None:
        self._config = config
        self._listener = Listener(config.channel_address, authkey=_authkey())
        self._followers: list[Connection] = []
        self._lock = threading.Lock()  # sends come from the engine thread, Stop from whoever shuts down
        self._stopping = False

    def accept_followers(self) -> None:
        """Blocks until every follower has connected (each does after its own warm-up)."""
        config = self._config
        logger.info("waiting for %d follower(s) on %s:%d", config.num_processes - 1, *config.channel_address)
        for _ in range(config.num_processes - 1):
            connection = self._listener.accept()
            self._followers.append(connection)
            threading.Thread(target=self._watch, args=(connection,), name="jaxserve-follower-watch",
                             daemon=True).start()

    def send(self, work: DeviceWork) -> None:
        with self._lock:
            for connection in self._followers:
                connection.send(work)

    def stop(self) -> None:
        """Tells the followers to exit (once)."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            for connection in self._followers:
                try:
                    connection.send(Stop())
                    connection.close()
                except OSError:
                    pass
        self._listener.close()

    def _watch(self, connection: Connection) -> None:
        with contextlib.suppress(EOFError, OSError):
            connection.recv_bytes()  # followers never send: this returns only when the connection closes
        if self._stopping:
            return
        logger.error("a follower process stopped; this server stops too (a step needs every process)")
        os.kill(os.getpid(), signal.SIGTERM)  # the server's graceful shutdown
        time.sleep(LOST_PEER_EXIT_S)
        logger.error("still running %.0fs after losing a follower: exiting now", LOST_PEER_EXIT_S)
        os._exit(1)


def connect_to_leader(config: ParallelConfig) -> Connection:
    """A follower's connection to the leader, retried while the leader is still loading."""
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        try:
            return Client(config.channel_address, authkey=_authkey())
        except (ConnectionRefusedError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
