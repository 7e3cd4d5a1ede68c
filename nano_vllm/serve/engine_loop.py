"""`EngineLoop`: one thread steps the engine; any number of client threads submit, stream and abort.

Continuous batching only pays off if concurrent requests land in the *same* engine: every HTTP handler
thread hands its request to this loop through a command queue and reads its tokens from its own queue
(`RequestStream`). The engine is touched by the loop thread alone, so it needs no locks; commands are
applied between steps, which is also when an aborted request's blocks are freed.

Nobody waits forever: when the loop stops, or its thread dies of an unexpected exception, every request it
still holds (or has queued) is ended — "abort" on `stop()`, "error" with the traceback otherwise — and
`alive` turns False, which the server's `/health` reports. A loop that is alive but stuck (a step that never
returns) is seen from outside too: `stalled_for()` is how long it has held work without coming round to
its next step, which the server's `/health` and `/metrics` report past `server.health_stall_s`.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

from nano_vllm.engine import LLMEngine
from nano_vllm.outputs import stop_reason
from nano_vllm.sampling_params import SamplingParams
from nano_vllm.sequence import Sequence


@dataclass
class StreamEvent:
    token_ids: list[int]  # new tokens since the last event
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    stop_token: bool = False  # finished at an EOS or stop token: the last of `token_ids` (text leaves it out)
    stop_reason: int | str | None = None  # the stop string or stop token id (not EOS) that ended it
    logprobs: list[dict] | None = None  # one {token id: Logprob} per token of `token_ids`, when asked for
    prompt_logprobs: list[dict | None] | None = None  # on the first event, when asked for


class RequestStream:
    """The client side of one request: `get(timeout)` returns the next StreamEvent or None on timeout."""

    def __init__(self, request_id: str, prompt_token_ids: list[int]):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []  # what the reader has taken; the loop thread never reads it
        self.sent = 0  # tokens the loop has put; the loop thread's alone
        self._events: queue.SimpleQueue[StreamEvent] = queue.SimpleQueue()

    def put(self, event: StreamEvent) -> None:
        self._events.put(event)

    def get(self, timeout: float | None = None) -> StreamEvent | None:
        try:
            event = self._events.get(timeout=timeout)
        except queue.Empty:
            return None
        self.output_token_ids.extend(event.token_ids)
        return event


class EngineLoop:
    """Owns an LLMEngine (or a subclass) and the thread that steps it.

    Each request has a *client*, the object its thread reads from: a `RequestStream` here. The loop only
    needs a client's `request_id`; how tokens and the end reach it is in `_emit` / `_end`, so another
    frontend (nano_sglang's `Runtime`) overrides those instead of copying the loop."""

    idle_wait_s = 0.5  # an idle loop re-checks `_stop` this often even if nothing wakes it

    def __init__(self, engine: LLMEngine, name: str = "nano_vllm-engine"):
        self.engine = engine
        self.last_progress = time.monotonic()  # when the loop thread last came round (a step done, or idle)
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._num_put, self._num_applied = 0, 0  # commands queued / taken off the queue and applied
        self._put_lock = threading.Lock()  # add and abort may come from several threads
        self._wake = threading.Event()
        self._clients: dict[str, Any] = {}  # request id -> client, for requests the engine holds
        self._ids = itertools.count()
        self._stop = False
        self.error: str | None = None  # the traceback that killed the loop thread, if one did
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> EngineLoop:
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self.thread.join(timeout=10)

    def submit(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
               **add_request_kwargs) -> RequestStream:
        """Queue a request (already validated by the caller); returns its stream."""
        stream = RequestStream(f"req-{next(self._ids)}", list(prompt_token_ids))
        self.add(stream, stream.prompt_token_ids, sampling_params, **add_request_kwargs)
        return stream

    def add(self, client: Any, prompt_token_ids: list[int], sampling_params: SamplingParams,
            **add_request_kwargs) -> None:
        """Queue a request for any client with a unique `request_id`; the keyword arguments go to the
        engine's `add_request` (e.g. nano_sglang's constraints)."""
        self._put(("add", client, prompt_token_ids, sampling_params, add_request_kwargs))
        if self.thread.ident is not None and not self.thread.is_alive():  # the loop has ended: answer now
            self._end_all("abort" if self.error is None else "error", self.error or "the engine loop has stopped")

    def abort(self, request_id: str) -> None:
        self._put(("abort", request_id))

    def _put(self, command: tuple) -> None:
        with self._put_lock:
            self._num_put += 1
            self._commands.put(command)
        self._wake.set()

    @property
    def num_active(self) -> int:
        return len(self._clients)

    @property
    def num_pending_commands(self) -> int:
        """Adds and aborts queued for the loop thread that it has not applied yet: a request whose add is
        pending is in neither `num_active` nor the engine."""
        return self._num_put - self._num_applied

    @property
    def has_work(self) -> bool:
        """Whether the loop holds requests or has commands queued (read from any thread)."""
        return self.num_pending_commands > 0 or len(self._clients) > 0

    def stalled_for(self) -> float:
        """Seconds the loop thread has held work without completing a step (or applying the commands
        queued): 0 while it has none, or when it comes round as it should."""
        return max(time.monotonic() - self.last_progress, 0.0) if self.has_work else 0.0

    @property
    def alive(self) -> bool:
        """True while the loop thread runs and has not been asked to stop."""
        return self.thread.is_alive() and not self._stop

    # ------------------------------------------------------------------ hooks (run on the loop thread)
    def _add(self, client: Any, prompt_token_ids: list[int], params: SamplingParams, kwargs: dict) -> Sequence:
        return self.engine.add_request(prompt_token_ids, params, request_id=client.request_id, **kwargs)

    def _step(self) -> tuple[list[Sequence], list[Sequence]]:
        return self.engine.step()

    def _emit(self, stream: RequestStream, seq: Sequence) -> None:
        """Send `seq`'s tokens since the last emit, and the end if it finished. A step usually adds one
        token, but counting covers several (jump-forward) and none (finished without sampling)."""
        sent = stream.sent
        new = seq.token_ids[seq.num_prompt_tokens + sent:]
        stream.sent += len(new)
        logprobs = None if seq.logprobs is None else seq.logprobs[sent: sent + len(new)]
        stream.put(StreamEvent(new, seq.is_finished, seq.finish_reason,
                               stop_token=seq.is_finished and seq.stop_token_id is not None,
                               stop_reason=stop_reason(seq) if seq.is_finished else None,
                               logprobs=logprobs, prompt_logprobs=None if sent or seq.sampling_params.prompt_logprobs is None
                               else seq.prompt_logprobs))

    def _end(self, stream: RequestStream, reason: str, error: str | None = None) -> None:
        """End a request the engine did not finish: "abort" or "error" (with the message)."""
        stream.put(StreamEvent([], True, reason, error))

    # ------------------------------------------------------------------ the loop thread
    def _pending(self):
        """The commands queued so far, taken off the queue one by one (counted as applied once the caller
        has handled each)."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                yield command
            finally:
                self._num_applied += 1

    def _apply_commands(self) -> None:
        for cmd in self._pending():
            if cmd[0] == "add":
                _, client, prompt_token_ids, params, kwargs = cmd
                try:
                    self._add(client, prompt_token_ids, params, kwargs)
                    self._clients[client.request_id] = client
                except ValueError as e:  # validated before, but never let one request stop the loop
                    self._end(client, "error", str(e))
                except Exception:
                    self._end(client, "error", traceback.format_exc(limit=5))
            else:
                client = self._clients.pop(cmd[1], None)
                if client is not None:
                    self.engine.abort_request(cmd[1])
                    self._end(client, "abort")

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException:  # a bug outside a step (a hook, an abort): record it, then end every client
            self.error = traceback.format_exc(limit=5)
        finally:
            self._end_all("abort" if self.error is None else "error", self.error)

    def _end_all(self, reason: str, error: str | None) -> None:
        """End every request this loop holds (aborted in the engine: their blocks are freed) or has queued."""
        clients = list(self._clients.items())
        self._clients.clear()
        for rid, _ in clients:
            with contextlib.suppress(Exception):  # after a crash the engine may be half-way through a step
                self.engine.abort_request(rid)
        clients = [c for _, c in clients] + [cmd[1] for cmd in self._pending() if cmd[0] == "add"]
        for client in clients:
            with contextlib.suppress(Exception):
                self._end(client, reason, error)

    def _serve(self) -> None:
        while not self._stop:
            self.last_progress = time.monotonic()
            self._apply_commands()
            if not self.engine.has_unfinished_requests():
                self._wake.wait(timeout=self.idle_wait_s)
                self._wake.clear()
                continue
            try:
                stepped, finished = self._step()
            except Exception:  # fail the requests in flight, keep serving new ones
                message = traceback.format_exc(limit=5)
                for rid, client in list(self._clients.items()):
                    with contextlib.suppress(Exception):  # the engine may be half-way through a step
                        self.engine.abort_request(rid)
                    self._end(client, "error", message)
                self._clients.clear()
                continue
            for seq in stepped:
                client = self._clients.get(seq.request_id)
                if client is None:
                    continue
                self._emit(client, seq)
                if seq.is_finished:
                    del self._clients[seq.request_id]
            # nano_vllm finishes a sequence only as it samples, but a subclass's scheduler may finish one
            # without a token this step; its client must still hear the end.
            for seq in finished:
                client = self._clients.pop(seq.request_id, None)
                if client is not None:
                    self._emit(client, seq)
