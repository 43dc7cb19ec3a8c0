"""The engine core in its own process (vLLM V1's split): scheduling and steps away from detokenizing and HTTP.

Processes and threads:
- The core process (spawned, so it starts its own JAX runtime) runs `_core_main`: it builds an
  `EngineCore` from the `EngineConfig`, sends a ready message (the engine's facts and its tokenizer),
  then loops: apply every command waiting on its pipe (blocking when it has no work), step, queue the
  step's updates and a stats snapshot as one message. A sender thread writes the messages, so the loop
  never waits on the frontend, and the frontend never waits on a core blocked in a write while the
  frontend itself blocks writing a command (two full pipes would deadlock).
- Grammars compile again in the core process (compiled matchers do not pickle), on two worker threads
  as in the API, with the core process's one `GrammarCompiler`; their sequences enter the scheduler when
  their grammar is ready. The frontend compiled
  each once already, within the API's timeout, so a bad or slow one never gets here.
- `CoreProcessClient` is the frontend's end. One thread uses it (the `LLMEngine`'s owner). `step()`
  takes every step the core has sent since the last call, waiting a few milliseconds for one at most,
  so that new requests and aborts reach the core while it steps; `stats()` takes what has come without
  waiting (updates it finds wait for the next `step()`). A profiler command waits for the core's answer
  (the steps sent before it are kept), so a trace the core cannot start or write fails its caller.
- The core process ignores SIGINT and SIGTERM (sent to the whole process group by a Ctrl-C or a service
  manager): the frontend drains first, then stops it.
- A fault the core cannot pin on one sequence ends the core process: it sends why, then exits. The
  frontend's `step()` raises `CoreProcessDied` for that, or for a core that vanished (its pipe closed),
  and the engine's callers treat it as any runtime fault. A core whose frontend vanished exits.
- `shutdown()` stops the core; it also runs at interpreter exit, before multiprocessing's own exit
  handler would wait forever for a daemon that ignores SIGTERM.
- Spawned, as multiprocessing's spawn requires: a script that builds an engine with `engine_process`
  at import time needs the `if __name__ == "__main__":` guard.
"""

import atexit
import contextlib
import importlib
import logging
import multiprocessing
import pickle
import queue
import signal
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from jaxserve.config import EngineConfig
from jaxserve.engine.core_io import (
    CoreOutputs,
    EngineInfo,
    EngineStats,
    FirstToken,
    SequenceDetails,
    SequenceFailure,
    engine_fault,
    failed,
)
from jaxserve.engine.request import Request, RequestStatus
from jaxserve.engine.structured_output import CompiledGrammar, GrammarCompiler
from jaxserve.models.peft import LoraAdapter
from jaxserve.process_exit import exit_now
from jaxserve.sampling_params import InvalidParam
from jaxserve.torch_free import keep_torch_out
from jaxserve.transformers_scan import remember_scans

if TYPE_CHECKING:
    from jaxserve.engine.core import EngineCore
    from jaxserve.engine.placement import RankPlacement

logger = logging.getLogger(__name__)

_IDLE_POLL_S = 0.005  # how often an idle core with grammars compiling looks for them
STEP_WAIT_S = 0.005  # the longest the frontend's step() waits for the core before it returns to its commands
CORE_PROCESS_NAME = "jaxserve-core"  # the core's process's name; a data-parallel rank's adds "-<rank>"


def _import_tokenizer_modules() -> None:
    try:
        importlib.import_module("transformers.tokenization_utils_base")
    except Exception:  # unpickling the tokenizer imports it again, and reports what fails
        logger.debug("importing transformers' tokenizer modules ahead of the core failed", exc_info=True)


class CoreProcessDied(RuntimeError):
    """The engine core's process failed or is gone."""


# Commands, frontend -> core: ("add", [Request]), ("finish", [seq id], RequestStatus), ("add_lora", id, adapter),
# ("remove_lora", id), ("start_profile", folder), ("stop_profile",), ("stop",).
# Messages, core -> frontend: ("ready", EngineInfo, tokenizer, warmup seconds), ("step", [CoreOutputs as
# plain tuples (`to_wire`)], EngineStats), ("answer", None or the exception) for a profiler command, ("dead",
# reason).
ANSWER_TIMEOUT_S = 300.0  # the longest a profiler command waits for the core: a stop writes the whole trace


class CoreProcessClient:
    def __init__(self, config: EngineConfig, warmup: bool = True, placement: "RankPlacement | None" = None,
                 wait: bool = True) -> None:
        """Starts the core's process and, with `wait`, waits until it is ready (else call `wait_ready()`).
        `placement`: the devices and CPUs of a data-parallel rank, which its process takes before jax starts."""
        context = multiprocessing.get_context("spawn")
        self.started_at = time.monotonic()
        self.ready_at: float | None = None  # when its ready message came
        self._conn, child_conn = context.Pipe()
        log_level = logging.getLogger("jaxserve").getEffectiveLevel()
        name = CORE_PROCESS_NAME if placement is None else f"{CORE_PROCESS_NAME}-{placement.rank}"
        self._process = context.Process(target=_core_main, args=(config, child_conn, log_level, warmup, placement),
                                        name=name, daemon=True)
        self._process.start()
        # The tokenizer's transformers modules, which unpickling the core's ready message would import: most
        # of a second otherwise spent after the core is ready, while this process only waits.
        importing = threading.Thread(target=_import_tokenizer_modules, name="jaxserve-imports", daemon=True)
        importing.start()
        child_conn.close()  # ours is the only end left here: the core's exit closes the pipe
        # Before multiprocessing's own exit handler (atexit runs last-registered first), which would wait
        # forever for a daemon that ignores SIGTERM: a script that never calls shutdown() still exits.
        atexit.register(self.shutdown)
        self._importing = importing
        self.ready = False
        self._stats = EngineStats()
        self._updates: list[CoreOutputs] = []  # received, not returned by step() yet
        self._received = False  # a step message came since the last step()
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Waits for the core's ready message (its facts, its tokenizer, its warm-up time), once."""
        if self.ready:
            return
        self._importing.join()  # done before the core is ready: the ready message's unpickling imports nothing
        kind, *body = self._receive()
        if kind != "ready":
            self.shutdown(5)
            raise CoreProcessDied(f"the engine core did not start: {body[0]}")
        self.info: EngineInfo
        self.info, self.tokenizer, self.warmup_seconds = body
        self.ready, self.ready_at = True, time.monotonic()

    def add_sequences(self, sequences: list[Request], grammar: CompiledGrammar | None = None) -> None:
        """Queues a request's sequences. A grammar compiles again in the core process (compiled matchers
        do not pickle), from the sequences' own `structured_outputs`."""
        self._send(("add", sequences))

    def finish(self, seq_ids: list[str], status: RequestStatus) -> None:
        self._send(("finish", seq_ids, status))

    def add_lora(self, lora_id: int, adapter: LoraAdapter) -> None:
        """Sends an adapter (read and checked here) to the core: before any request of it, in pipe order."""
        self._send(("add_lora", lora_id, adapter))

    def remove_lora(self, lora_id: int) -> None:
        self._send(("remove_lora", lora_id))

    def start_profile(self, log_dir: str) -> None:
        """Starts the core's trace; raises what the core raised (a trace it runs already, a folder it
        cannot use)."""
        self._ask(("start_profile", log_dir))

    def stop_profile(self) -> None:
        """Ends the core's trace once it is written; raises what the core raised."""
        self._ask(("stop_profile",))

    def _ask(self, command: tuple, timeout: float = ANSWER_TIMEOUT_S) -> None:
        """Sends a command the core answers, and waits for the answer; the step messages sent before it
        are kept for `step()`."""
        self._send(command)
        deadline = time.monotonic() + timeout
        while self._conn.poll(max(deadline - time.monotonic(), 0)):
            message = self._receive()
            if message[0] != "answer":
                self._take(message)
                continue
            if message[1] is not None:
                raise message[1]
            return
        raise TimeoutError(f"the engine core did not answer {command[0]} within {timeout:g} s")

    @property
    def connection(self) -> Connection:
        """The frontend's end of the pipe, readable when the core has sent something."""
        return self._conn

    @property
    def has_updates(self) -> bool:
        """A step message came since the last `step()`."""
        return self._received

    def step(self, timeout: float = STEP_WAIT_S) -> list[CoreOutputs]:
        """The updates of every step the core has sent since the last call. Waits up to `timeout` s for one
        if none came, and returns [] after that: the caller's new commands reach the core without waiting
        for its step (or for a grammar it is compiling)."""
        if not self._received and self._conn.poll(timeout):
            self._take(self._receive())
        self._take_waiting()
        updates, self._updates, self._received = self._updates, [], False
        return updates

    def stats(self) -> EngineStats:
        """The core's latest snapshot (it sends one after every step, and one when it goes idle)."""
        self._take_waiting()
        return self._stats

    def _take_waiting(self) -> None:
        while self._conn.poll(0):
            self._take(self._receive())

    def _take(self, message: tuple) -> None:
        kind, *body = message
        if kind == "answer":  # to a profiler command whose wait timed out
            return
        if kind != "step":
            raise CoreProcessDied(f"the engine core failed: {body[0]}")
        self._updates += [from_wire(item) for item in body[0]]
        self._stats = body[1]
        self._received = True

    def stop(self) -> None:
        """Tells the core to stop (it drops what it runs), without waiting; `shutdown()` waits."""
        if not self._conn.closed:
            with contextlib.suppress(CoreProcessDied):  # already gone
                self._send(("stop",))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the core (it drops what it runs) and waits up to `timeout` s before killing it."""
        atexit.unregister(self.shutdown)
        if self._conn.closed:
            return
        self.stop()
        deadline = time.monotonic() + timeout
        while self._process.is_alive() and time.monotonic() < deadline:
            try:  # keep reading: a core whose sender is blocked on a full pipe could not finish
                if self._conn.poll(0.05):
                    self._conn.recv()
            except (EOFError, OSError):
                self._process.join(max(0.0, deadline - time.monotonic()))
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._conn.close()

    def _send(self, command: tuple) -> None:
        try:
            self._conn.send(command)
        except (OSError, ValueError) as e:  # the pipe is closed: the core is gone
            raise CoreProcessDied(f"the engine core is gone: {e!r}") from e

    def _receive(self) -> tuple:
        try:
            return self._conn.recv()
        except (EOFError, OSError) as e:
            raise CoreProcessDied(f"the engine core exited (code {self._process.exitcode})") from e


def step_message(outputs: list[CoreOutputs], stats: EngineStats) -> tuple:
    """What the core sends for its steps."""
    return "step", [to_wire(item) for item in outputs], stats


def to_wire(outputs: CoreOutputs) -> tuple:
    """A step's outputs as plain tuples: a NamedTuple pickles through its class, 4x slower than a tuple (0.3 ms
    for 256 records), and a step's details can be that many (every sequence's first token)."""
    details = {index: (*detail[:4], None if detail.first is None else tuple(detail.first), *detail[5:])
               for index, detail in outputs.details.items()}
    return (*outputs[:4], details, [tuple(failure) for failure in outputs.failures])


def from_wire(wire: tuple) -> CoreOutputs:
    seq_ids, token_ids, logprobs, time_, details, failures = wire
    details = {index: SequenceDetails(*detail[:4], None if detail[4] is None else FirstToken(*detail[4]), *detail[5:])
               for index, detail in details.items()}
    return CoreOutputs(seq_ids, token_ids, logprobs, time_, details, [SequenceFailure(*f) for f in failures])


def _core_main(config: EngineConfig, conn: Connection, log_level: int, warmup: bool,
               placement: "RankPlacement | None" = None) -> None:
    """The core process: take the rank's devices and CPUs (data parallelism), build the core, then step while
    there is work.

    It ignores SIGINT and SIGTERM: a Ctrl-C or a service manager signals the whole process group, and the
    frontend, which drains its requests first, says when to stop (or its exit closes the pipe)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    tag = "core" if placement is None else f"core {placement.rank}"
    logging.basicConfig(format=f"%(asctime)s %(levelname)s %(name)s [{tag}]: %(message)s")
    logging.getLogger("jaxserve").setLevel(log_level)
    outbox: queue.Queue = queue.Queue()
    sender = threading.Thread(target=_send_all, args=(conn, outbox), name="jaxserve-core-sender", daemon=True)
    sender.start()
    code = 0
    try:
        if placement is not None:
            placement.apply()  # before jax starts a backend
        keep_torch_out(config.model.model)  # before transformers is imported
        remember_scans()
        from jaxserve.engine.core import EngineCore  # imports jax: in this process only

        core = EngineCore(config, warmup=warmup)
        outbox.put(("ready", core.info, core.model.tokenizer, core.warmup_seconds))
        _CoreLoop(core, conn, outbox).run()
    except EOFError:  # the frontend's end of the pipe closed: its process is gone
        logger.info("the frontend is gone; the engine core stops")
    except BaseException:
        logger.exception("the engine core failed")
        outbox.put(("dead", repr(sys.exc_info()[1])))
        code = 1
    finally:
        outbox.put(None)
        sender.join(10)
    exit_now(code)  # compiles a background warm-up still runs are not waited for


def _send_all(conn: Connection, outbox: queue.Queue) -> None:
    while (message := outbox.get()) is not None:
        try:
            conn.send(message)
        except OSError:  # the frontend is gone; the loop sees its pipe close too
            return


def _picklable(error: Exception) -> Exception:
    """`error` if it crosses the pipe as itself, else a RuntimeError saying what it was."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


class _CoreLoop:
    def __init__(self, core: "EngineCore", conn: Connection, outbox: queue.Queue) -> None:
        self.core = core
        self.conn = conn
        self.outbox = outbox
        self.grammars = GrammarCompiler(core.model.tokenizer, core.model.cfg.vocab_size, core.model.eos_token_ids)
        self.grammar_pool = ThreadPoolExecutor(2, "jaxserve-core-grammar")  # as many as the API's
        self.compiling: list[tuple[list[Request], Future]] = []  # sequences waiting for their grammar
        self.failed: list[SequenceFailure] = []  # adds refused here, reported with the next step
        # an adapter removed while a request of it compiles its grammar stays until that request ends
        core.lora_waiting = lambda lora_id: any(seqs[0].lora_id == lora_id for seqs, _ in self.compiling)

    def run(self) -> None:
        sent_stats = None
        while self._apply_commands():
            self._admit_compiled()
            updates, self.failed = [failed(self.failed)] if self.failed else [], []
            if self.core.has_unfinished():
                updates += self.core.step()
            stats = self.core.stats()
            if updates or stats != sent_stats:  # idle after finishing or aborting: the last snapshot still goes
                self.outbox.put(step_message(updates, stats))
                sent_stats = stats
        self.core.shutdown()

    def _apply_commands(self) -> bool:
        """Applies every waiting command (waiting for one when there is no work); False on stop."""
        idle = not self.core.has_unfinished() and not self.failed
        timeout = (_IDLE_POLL_S if self.compiling else None) if idle else 0
        while self.conn.poll(timeout):
            timeout = 0
            command = self.conn.recv()  # EOFError if the frontend is gone: the process ends
            if command[0] == "stop":
                return False
            if command[0] == "finish":
                self.core.finish(command[1], command[2])
                self._drop_compiling(set(command[1]))
            elif command[0] == "add_lora":
                self.core.add_lora(command[1], command[2])
            elif command[0] == "remove_lora":
                self.core.remove_lora(command[1])
            elif command[0] in ("start_profile", "stop_profile"):
                self._profile(command)
            else:
                self._add(command[1])
        return True

    def _profile(self, command: tuple) -> None:
        """Starts or stops the trace and answers: None, or the exception (a trace running already, a folder
        it cannot write), which the frontend raises; the core serves on either way."""
        error = None
        try:
            if command[0] == "start_profile":
                self.core.start_profile(command[1])
            else:
                self.core.stop_profile()
        except Exception as e:
            logger.warning("the profiler could not %s: %r", command[0].replace("_profile", ""), e)
            error = _picklable(e)
        self.outbox.put(("answer", error))

    def _add(self, sequences: list[Request]) -> None:
        spec = sequences[0].sampling_params.structured_outputs
        if spec is None:
            self._admit(sequences, None)
        else:
            self.compiling.append((sequences, self.grammar_pool.submit(self.grammars.compile, spec)))

    def _admit_compiled(self) -> None:
        waiting = []
        for sequences, future in self.compiling:
            if not future.done():
                waiting.append((sequences, future))
                continue
            try:
                grammar = future.result()
            except Exception as e:
                self._refuse(sequences, e)
                continue
            self._admit(sequences, grammar)
        if len(waiting) < len(self.compiling):
            self.compiling = waiting
            self.core.drop_retired_loras()  # a refused one may have been a removed adapter's last
    def _admit(self, sequences: list[Request], grammar: CompiledGrammar | None) -> None:
        try:
            self.core.add_sequences(sequences, grammar)
        except Exception as e:  # the frontend checked the request: this is the engine's fault, this request's alone
            self._refuse(sequences, e)

    def _refuse(self, sequences: list[Request], error: Exception) -> None:
        logger.error("request of sequence %s could not be added: %r", sequences[0].request_id, error, exc_info=error)
        message, param = (str(error), error.param) if isinstance(error, InvalidParam) else (engine_fault(error), None)
        self.failed += [SequenceFailure(seq.request_id, message, param) for seq in sequences]

    def _drop_compiling(self, seq_ids: set[str]) -> None:
        self.compiling = [(seqs, future) for seqs, future in self.compiling
                          if not any(seq.request_id in seq_ids for seq in seqs)]
        self.core.drop_retired_loras()
