"""The engine core's own process: schedule, run the model, sample, and send one message per step.

    API process (ProcessEngine)                         engine process (this module)
    ───────────────────────────                         ───────────────────────────
    HTTP, tokenization, detokenization,   ADD/ABORT ─▶  EngineCore: scheduler, runner, sampler,
    stop sequences, streams               ◀─ OUT        EOS / length checks, KV rows

Everything crossing the pipe is a plain tuple, pickled once per message. ``OUT`` carries every
token event of one loop iteration (each ``TokenEvent`` as the tuple of its fields, ``text`` left
empty: the API process fills it in), the requests the core refused, and a stats snapshot.

``ProcessEngine`` starts it as a fresh interpreter (``BOOTSTRAP``; never a fork: torch and fork do
not mix, and unlike ``multiprocessing``'s spawn it never re-imports the caller's ``__main__``). It
builds its ``EngineCore`` with a picklable factory (``backends.cpu.engine.cpu_engine_core`` for the
CPU backend), ignores SIGINT/SIGTERM (the API process decides when it stops: a drain must not lose
its engine to a signal sent to the whole process group) and exits when the socket closes, or when
the API process is gone however it ended (``exit_with_parent``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import operator
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from neuron_lmi.engine.admission import AdmissionLimits, ValidRequest
from neuron_lmi.engine.step_clock import StepClock
from neuron_lmi.engine.types import InvalidRequestError, SamplingParams, TokenEvent, UnknownAdapterError

log = logging.getLogger(__name__)

# Messages to the engine process (after the bootstrap's sys.path and (factory, log level, format)):
#   (ADD, request_id, prompt_ids, params_tuple(params))   (ABORT, request_id)   (STOP,)
#   (LOAD_ADAPTER, token, name, path)   (UNLOAD_ADAPTER, token, name)
ADD, ABORT, STOP = "add", "abort", "stop"
LOAD_ADAPTER, UNLOAD_ADAPTER = "load_adapter", "unload_adapter"
# Messages from it: (READY, EngineInfo) or (FAILED, exception) once, then per loop iteration
#   (OUT, [event_tuple(event), ...], [(request_id, message, field), ...], stats, adds_taken)
# and (DEAD, reason) if the loop dies; each LOAD/UNLOAD_ADAPTER is answered at once with
#   (ADAPTER_DONE, token, None) or (ADAPTER_DONE, token, (message, field, not_found))
READY, FAILED, OUT, DEAD, ADAPTER_DONE = "ready", "failed", "out", "dead", "adapter_done"

IDLE_POLL_S = 0.05
UNEXPECTED = "\0unexpected"  # the ``field`` of a refusal that was an engine error, not a bad request
EVENT_FIELDS = tuple(f.name for f in dataclasses.fields(TokenEvent))
event_tuple = operator.attrgetter(*EVENT_FIELDS)
REQUEST_ID, TOKEN_ID, TOKEN_TEXT, TEXT, FINISH = (
    EVENT_FIELDS.index(name) for name in ("request_id", "token_id", "token_text", "text", "finish_reason")
)
assert TEXT == TOKEN_TEXT + 1, "with_text writes the two texts side by side"


def with_text(fields: tuple[Any, ...], token_text: str, text: str, finish: Any) -> tuple[Any, ...]:
    """An event tuple with its ``token_text``, ``text`` and ``finish_reason`` replaced (the API
    process's part: the core sends ids only)."""
    return (*fields[:TOKEN_TEXT], token_text, text, *fields[TEXT + 1 : FINISH], finish, *fields[FINISH + 1 :])


# SamplingParams travel as the tuple of their fields: pickling the frozen dataclass itself costs
# ~40x more (its __getstate__ walks dataclasses.fields() on every call).
PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.init)
params_tuple = operator.attrgetter(*PARAM_FIELDS)


def params_from(values: tuple[Any, ...]) -> SamplingParams:
    return SamplingParams(**dict(zip(PARAM_FIELDS, values, strict=True)))


CoreFactory = Callable[[], Any]  # () -> EngineCore, picklable (a module-level function or partial)


@dataclasses.dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the API process needs to know about the engine it talks to: what admission checks
    requests against (its queue bound left to the API side), and the tokenizer."""

    limits: AdmissionLimits
    tokenizer: Any
    adapters: dict[str, str] = dataclasses.field(default_factory=dict)  # LoRA name -> path, at start


# Run by ``python -c BOOTSTRAP FD PID`` in a fresh interpreter (PID: the API process's): take the
# API process's ``sys.path`` first, so that the factory unpickles against the same code, then serve
# on the socket FD.
BOOTSTRAP = """
import sys
from multiprocessing.connection import Connection
conn = Connection(int(sys.argv[1]))
sys.path[:] = conn.recv()
from neuron_lmi.engine.process_worker import engine_main
engine_main(conn, int(sys.argv[2]))
"""
PARENT_POLL_S = 0.5


def exit_with_parent(parent_pid: int) -> None:
    """End this process as soon as ``parent_pid`` is no longer its parent, whatever ended it
    (SIGKILL, a crash) and whatever this process is doing: loading or compiling a model reads no
    socket for minutes, and an orphaned engine holds its memory (on Neuron, its NeuronCores) from
    the next start. A thread polls: ``PR_SET_PDEATHSIG`` would fire when the *thread* that spawned
    this process ends, which need not be the API process's end."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        log.warning("the API process %d is gone; the engine process %d exits", parent_pid, os.getpid())
        logging.shutdown()
        os._exit(1)

    threading.Thread(target=watch, name="neuron-lmi-parent-watch", daemon=True).start()


def engine_main(conn: Connection, parent_pid: int) -> None:
    """The engine process's entry point: receive (factory, log level, log format), build, serve;
    end with the API process ``parent_pid`` (``exit_with_parent``)."""
    exit_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        factory, log_level, log_format = conn.recv()
    except (EOFError, OSError):
        return  # the API process went away before sending the factory
    logging.basicConfig(level=log_level, format=log_format or logging.BASIC_FORMAT)
    try:
        core = factory()
        info = EngineInfo(core.admission_limits(0), core.tokenizer, core.adapter_names())
    except BaseException as exc:  # a missing model (FileNotFoundError) included: the API side raises it
        log.exception("the engine process could not build its engine")
        with contextlib.suppress(OSError):
            conn.send((FAILED, _picklable(exc)))
        return
    # Everything built so far (weights, packages, tokenizer: long-lived) leaves the collector's
    # view: its full passes, set off by the objects every step allocates, no longer walk it.
    gc.collect()
    gc.freeze()
    try:
        conn.send((READY, info))
        EngineLoop(core, conn).run()
    except (EOFError, OSError):
        pass  # the API process went away
    finally:
        conn.close()


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class EngineLoop:
    """Drain messages, step the core, send what the step produced; repeat until STOP or EOF.

    Invariants: every event the core emits in an iteration leaves in that iteration's one OUT
    message; the core does token-level work only (text and stop sequences are the API process's).
    """

    def __init__(self, core: Any, conn: Connection) -> None:
        self.core = core
        self.conn = conn
        self.clock = StepClock(core.forward_timer, core.runner.rows.n_rows)
        self.outbox: list[tuple[Any, ...]] = []
        self.rejected: list[tuple[str, str, str | None]] = []
        self.received = 0

    def run(self) -> None:
        try:
            while True:
                if not self.core.has_work():
                    self.conn.poll(IDLE_POLL_S)
                self.clock.begin()
                if not self._drain():
                    return
                stepped = self.core.has_work()
                if stepped:
                    self.core.step()
                if stepped or self.outbox or self.rejected:
                    self._send()
                if stepped:
                    self.clock.end()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            raise  # the API process went away
        except BaseException as exc:  # the loop dying must be loud: the API side turns unhealthy
            log.exception("engine loop died")
            # What the core finished before it died goes out; the requests still running are the
            # API side's to fail (with the death's reason), as when this process is killed.
            self._send()
            self.conn.send((DEAD, f"{type(exc).__name__}: {exc}"))

    def _sink(self, event: TokenEvent) -> None:
        self.outbox.append(event_tuple(event))

    def _drain(self) -> bool:
        """Apply every message already waiting; False on STOP."""
        while self.conn.poll(0):
            message = self.conn.recv()
            kind = message[0]
            if kind == ADD:
                _, request_id, prompt_ids, params = message
                self.received += 1
                try:  # admitted by the API process: built, not checked again
                    valid = ValidRequest(request_id, prompt_ids, params_from(params))
                    request = self.core.request_of(valid, sink=self._sink)
                except InvalidRequestError as exc:
                    self.rejected.append((request_id, str(exc), exc.field))
                    continue
                except Exception as exc:  # one bad request must not take the engine down
                    log.exception("request %s could not be built", request_id)
                    self.rejected.append((request_id, f"{type(exc).__name__}: {exc}", UNEXPECTED))
                    continue
                self.core.add(request)
            elif kind == ABORT:
                self.core.abort(message[1])
            elif kind in (LOAD_ADAPTER, UNLOAD_ADAPTER):
                self._adapter(message)
            elif kind == STOP:
                return False
        return True

    def _adapter(self, message: tuple[Any, ...]) -> None:
        """Load or unload an adapter and answer at once (the API side awaits the answer)."""
        token, name = message[1], message[2]
        outcome = None
        try:
            if message[0] == LOAD_ADAPTER:
                self.core.load_adapter(name, message[3])
            else:
                self.core.unload_adapter(name)
        except InvalidRequestError as exc:
            outcome = (str(exc), exc.field, isinstance(exc, UnknownAdapterError))
        except Exception as exc:  # a broken adapter must not take the engine down
            log.exception("adapter %s could not be %sed", name, message[0].split("_")[0])
            outcome = (f"{type(exc).__name__}: {exc}", UNEXPECTED, False)
        self.conn.send((ADAPTER_DONE, token, outcome))

    def _send(self) -> None:
        stats = self.core.stats()
        extra = {**stats.extra, **self.clock.snapshot()}
        snapshot = (
            stats.rows_total, stats.rows_used, stats.positions_used, stats.waiting, stats.running, extra
        )  # fmt: skip
        self.conn.send((OUT, self.outbox, self.rejected, snapshot, self.received))
        self.outbox, self.rejected = [], []
