"""AsyncEngine: the LLMEngine on a background thread, fed and drained from asyncio.

Threads and queues:
- One engine thread owns the LLMEngine and is the only code that touches it (a second AsyncEngine on the
  same LLMEngine is refused while the first one's thread lives). It loops: apply pending
  commands (add / abort) from a thread-safe `queue.Queue`, run `engine.step()`, hand the step's
  RequestOutputs to their requests' `asyncio.Queue`s with one `loop.call_soon_threadsafe` per event loop
  (each call writes to the loop's self-pipe: one per request would be 256 system calls per step at 256
  streams). With no work it waits on the command queue, waking twice a second to refresh `stats`.
- The event loop never waits on the device. `generate()` is an async iterator over one request's queue;
  leaving it early (client gone, task cancelled) sends an abort, which frees the request's KV pages at
  the start of the next engine iteration (with a core process: once the core reads it, a step later).
- With `engine_process`, the LLMEngine's core runs in its own process and `engine.step()` waits on its
  pipe for a few milliseconds at a time: this thread then only checks requests, detokenizes and
  delivers, and shares the GIL with the event loop alone.
- The GIL is released while XLA runs a step, so the event loop keeps serving HTTP during device work.
- Faults are sorted by cause. One request's bad data (its batch row, its detokenization) fails that
  request alone with RequestFailedError, and the engine serves on. Anything else raised by a step (the
  device, the runtime) kills the engine: every live request gets EngineDeadError, later calls raise it,
  nothing waits forever, and the server drains and exits non-zero so a supervisor restarts it.
- Everything the API needs to know about the engine is copied once, before the thread starts, into
  `info` (a frozen record) and `tokenizer` (a copy: fast tokenizers must not be shared across threads).
- Structured-output grammars compile on their own small thread pool (`compile_grammar`), never on the
  engine thread or the event loop; the compiled grammar travels with the add command, and the engine
  thread only forks a matcher from it per sequence (a core process compiles it again on its own
  threads: compiled matchers do not pickle).
"""

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import weakref
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from jaxserve.config import LoraModule
from jaxserve.engine.core_io import EngineInfo, EngineStats
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.structured_output import CompiledGrammar
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import InvalidParam, SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped (a runtime fault or shutdown); no request can be served."""


class RequestFailedError(RuntimeError):
    """The engine failed this one request (or ended it at shutdown) and serves on."""


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    outputs: "asyncio.Queue[RequestOutput | BaseException]"
    cache_salt: str | None = None
    grammar: CompiledGrammar | None = None
    checked: bool = False  # see LLMEngine.add_request
    priority: int = 0
    lora_name: str | None = None


@dataclass
class _Abort:
    request_id: str
    # The stream it ends: the request is aborted only while that stream is the id's (an add that was refused,
    # say for an id in use, must not abort the request that holds the id). None: whichever stream it is.
    outputs: "asyncio.Queue[RequestOutput | BaseException] | None" = None


@dataclass
class _FailAll:
    reason: str


@dataclass
class _Call:
    """Runs `work(engine)` on the engine thread; its result or exception goes to `future` on `loop`."""

    work: Callable[[LLMEngine], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


_STOP = object()
# The thread driving each LLMEngine: two would step one engine at once (donated device buffers used twice,
# one taking the other's outputs), so a second AsyncEngine waits for the first's shutdown.
_drivers: "weakref.WeakKeyDictionary[LLMEngine, threading.Thread]" = weakref.WeakKeyDictionary()
_drivers_lock = threading.Lock()
_IDLE_REFRESH_S = 0.5  # an idle engine thread wakes this often to refresh `stats` (a core process's come late)


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    """On the event loop: one step's outputs into their requests' queues."""
    for outputs, item in items:
        outputs.put_nowait(item)


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.info: EngineInfo = engine.info
        self.tokenizer = engine.tokenizer_copy()  # for other threads; the engine thread has its own
        self._grammars = engine.grammars  # thread-safe; only compile() is called from here
        self._grammar_pool = ThreadPoolExecutor(2, "jaxserve-grammar")
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Add] = {}  # touched by the engine thread only
        self._ids = itertools.count()
        self._dead: BaseException | None = None
        self._lock = threading.Lock()  # orders "put a command" against "the engine died"
        self.stats = EngineStats()  # replaced whole by the engine thread, so readers see a consistent one
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        with _drivers_lock:
            driver = _drivers.get(engine)
            if driver is not None and driver.is_alive():
                raise RuntimeError("this LLMEngine is driven by another AsyncEngine: shut that one down first")
            _drivers[engine] = self._thread
            self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
        grammar: CompiledGrammar | None = None,
        checked: bool = False,
        priority: int = 0,
        lora_name: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streams a request's outputs until it finishes. Bad input raises ValueError on first use.
        `grammar`: params.structured_outputs from `compile_grammar` (else the engine thread compiles it).
        `checked`: the caller checked the prompt and params against the engine's limits already."""
        request_id = request_id or f"req-{next(self._ids)}"
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        with self._lock:
            if not self.is_running:
                raise EngineDeadError(f"the engine is not running: {self._dead!r}")
            self._commands.put(_Add(request_id, prompt, params, asyncio.get_running_loop(), outputs, cache_salt,
                                    grammar, checked, priority, lora_name))
        finished = False
        try:
            while not finished:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._commands.put(_Abort(request_id, outputs))

    async def compile_grammar(self, spec: StructuredOutputsParams, timeout: float) -> CompiledGrammar:
        """Compiles a structured output on the grammar threads. InvalidParam for a definition that fails
        or takes longer than `timeout` seconds (its compile finishes in the background, bounded by
        llguidance's own limits)."""
        future = asyncio.get_running_loop().run_in_executor(self._grammar_pool, self._grammars.compile, spec)
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise InvalidParam(f"the structured output did not compile within {timeout:g} s", "structured_outputs"
                               ) from None

    def abort(self, request_id: str) -> None:
        """Drops a live request: its pages are freed and its stream ends with RequestFailedError."""
        self._commands.put(_Abort(request_id))

    @property
    def lora_modules(self) -> list[LoraModule]:
        """The LoRA adapters served (`--lora-modules`, and those loaded since), in the order they came."""
        return [module for module, _ in self.engine.lora_modules.values()]

    def has_adapter(self, name: str) -> bool:
        return name in self.engine.lora_modules

    async def load_lora(self, module: LoraModule, replace: bool = False) -> None:
        """Reads the adapter on a worker thread (the engine keeps stepping), then serves it, in place of the
        one of its name with `replace`; ValueError for an adapter that cannot be served or (without
        `replace`) a name already served."""
        adapter = await asyncio.to_thread(self.engine.read_lora, module)
        await self._call(lambda engine: engine.add_lora(module, adapter, replace))

    async def remove_lora(self, name: str) -> None:
        """Stops serving adapter `name` (requests already added finish with it); KeyError if not served."""
        await self._call(lambda engine: engine.remove_lora(name))

    async def start_profile(self, log_dir: str) -> None:
        """`LLMEngine.start_profile` on the engine thread, between steps."""
        await self._call(lambda engine: engine.start_profile(log_dir))

    async def stop_profile(self) -> str:
        """`LLMEngine.stop_profile` on the engine thread: waits for the device, then writes the trace."""
        return await self._call(lambda engine: engine.stop_profile())

    async def _call(self, work: Callable[[LLMEngine], Any]) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            if not self.is_running:
                raise EngineDeadError(f"the engine is not running: {self._dead!r}")
            self._commands.put(_Call(work, loop, future))
        return await future

    def fail_all(self, reason: str) -> None:
        """Ends every live request with EngineDeadError(reason): a shutdown past its deadline."""
        self._commands.put(_FailAll(reason))

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stops the engine thread; requests still in flight are dropped."""
        self._commands.put(_STOP)
        self._thread.join(timeout)
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)
        self.engine.shutdown()
        with self._lock:
            self._dead = self._dead or EngineDeadError("the engine was shut down")
            self._fail_pending(EngineDeadError("the engine was shut down"))

    # Engine thread below.

    def _run(self) -> None:
        try:
            while True:
                block = not self.engine.has_unfinished_requests()
                if not self._apply_commands(block):
                    return
                outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
                # Stats before the outputs: a client that has its answer and then reads /metrics sees the
                # state after the step that finished it (its request no longer running).
                self.stats = self.engine.stats()
                self._deliver(outputs)
        except BaseException as e:
            logger.exception("engine step failed; the engine is dead")
            error = EngineDeadError(f"engine failed: {e!r}")
            with self._lock:
                self._dead = e
                self._fail_streams(error)
                self._fail_pending(error)

    def _fail_streams(self, error: EngineDeadError) -> None:
        """Ends every live request's stream with `error` (on its loop, unless that loop is closed)."""
        for stream in self._streams.values():
            with contextlib.suppress(RuntimeError):  # a loop closed under its caller: nobody waits there
                stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, error)
        self._streams.clear()

    def _apply_commands(self, block: bool) -> bool:
        """Applies queued commands (waiting for one if `block`); False once asked to stop."""
        while True:
            try:
                command = self._commands.get(block=block, timeout=_IDLE_REFRESH_S if block else None)
            except queue.Empty:
                return True
            block = False
            if command is _STOP:  # the requests still streaming end with an error, not a wait forever
                self._fail_streams(EngineDeadError("the engine was shut down"))
                return False
            if isinstance(command, _Abort):
                self._abort(command)
                continue
            if isinstance(command, _Call):
                self._answer(command)
                continue
            if isinstance(command, _FailAll):
                self.engine.abort_request(list(self._streams))
                self._fail_streams(EngineDeadError(command.reason))
                continue
            try:
                self.engine.add_request(command.request_id, command.prompt, command.params, command.cache_salt,
                                        command.grammar, command.checked, command.priority, command.lora_name)
            except Exception as e:  # bad input (ValueError) or a tokenizer fault: this request's alone
                if not isinstance(e, ValueError):
                    logger.error("request %s could not be added: %r", command.request_id, e, exc_info=e)
                    e = RequestFailedError(f"the engine could not add this request: {type(e).__name__}")
                command.loop.call_soon_threadsafe(command.outputs.put_nowait, e)
                continue
            self._streams[command.request_id] = command

    def _abort(self, command: _Abort) -> None:
        stream = self._streams.get(command.request_id)
        if stream is None or (command.outputs is not None and stream.outputs is not command.outputs):
            return  # finished already, or the id is another stream's (this one's add was refused)
        self.engine.abort_request(command.request_id)
        del self._streams[command.request_id]
        if command.outputs is None:  # aborted by id (`abort`): whoever reads the stream learns that it ended
            with contextlib.suppress(RuntimeError):  # a loop closed under its caller: nobody waits there
                stream.loop.call_soon_threadsafe(
                    stream.outputs.put_nowait, RequestFailedError(f"request {command.request_id} was aborted"))

    def _answer(self, call: _Call) -> None:
        def settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
            if future.done():  # its caller was cancelled
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        try:
            result, error = call.work(self.engine), None
        except Exception as e:  # the caller's to handle (a name already served, one not served)
            result, error = None, e
        call.loop.call_soon_threadsafe(settle, call.future, result, error)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hands a step's outputs to their streams: one wake-up per event loop, not one per request."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput | BaseException]]] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            item: RequestOutput | BaseException = output
            if output.error is not None:  # a client error (a 400) or the engine's (a 500)
                item = InvalidParam(output.error, output.error_param) if output.error_param else RequestFailedError(
                    output.error)
            by_loop.setdefault(stream.loop, []).append((stream.outputs, item))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _fail_pending(self, error: BaseException) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                command.loop.call_soon_threadsafe(command.outputs.put_nowait, error)
            elif isinstance(command, _Call):
                command.loop.call_soon_threadsafe(
                    lambda future=command.future: future.done() or future.set_exception(error))
