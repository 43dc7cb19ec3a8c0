"""A multi-host follower process: the same engine core as the leader's, replaying the leader's device work.

Every process of a multi-host job builds the same `EngineCore` (its shards of the weights, the same
warm-up); the followers then only run, in their main thread, each step the leader's runner broadcasts
(`jaxserve.runner.multihost`), so the collectives inside meet. They schedule nothing and read no results.
"""

import logging
from multiprocessing.connection import Connection

from jaxserve.config import EngineConfig
from jaxserve.engine.core import EngineCore
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.multihost import LoadSeenTokens, Step, Stop, connect_to_leader

logger = logging.getLogger(__name__)


def follow(runner: ModelRunner, connection: Connection) -> None:
    """Replays the leader's device work until it says Stop or its connection drops."""
    while True:
        try:
            work = connection.recv()
        except (EOFError, OSError):
            logger.error("the leader process stopped; this follower stops too")
            return
        if isinstance(work, Stop):
            logger.info("the leader stopped; this follower stops too")
            return
        if isinstance(work, Step):
            runner.run_step(work.batch, work.bucket, work.greedy, work.decode_steps)
        elif isinstance(work, LoadSeenTokens):
            runner.replay_seen_tokens(work.slot, work.token_ids, work.num_prompt_tokens)
        else:
            raise TypeError(f"unknown work from the leader: {type(work).__name__}")


def run_follower(config: EngineConfig) -> None:
    """A follower process: builds the leader's engine core, then replays its device work until it stops."""
    core = EngineCore(config)
    connection = connect_to_leader(config.parallel)
    logger.info("process %d: following the leader at %s:%d", config.parallel.process_id,
                *config.parallel.channel_address)
    try:
        follow(core.runner, connection)
    finally:
        connection.close()
