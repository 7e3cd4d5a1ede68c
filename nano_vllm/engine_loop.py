"""`EngineLoop`: one thread steps the engine; any number of client threads submit, stream and abort.

Continuous batching only pays off if concurrent requests land in the *same* engine: every HTTP handler
thread hands its request to this loop through a command queue and reads its tokens from its own queue
(`RequestStream`). The engine is touched by the loop thread alone, so it needs no locks; commands are
applied between steps, which is also when an aborted request's blocks are freed.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import traceback
from dataclasses import dataclass

from nano_vllm.engine import LLMEngine
from nano_vllm.sampling_params import SamplingParams


@dataclass
class StreamEvent:
    token_ids: list[int]  # new tokens since the last event
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None


class RequestStream:
    """The client side of one request: `get(timeout)` returns the next StreamEvent or None on timeout."""

    def __init__(self, request_id: str, prompt_token_ids: list[int]):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
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
    """Owns an LLMEngine and the thread that steps it."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._ids = itertools.count()
        self._stop = False
        self.thread = threading.Thread(target=self._run, name="nano_vllm-engine", daemon=True)

    def start(self) -> EngineLoop:
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self.thread.join(timeout=10)

    def submit(self, prompt_token_ids: list[int], sampling_params: SamplingParams) -> RequestStream:
        """Queue a request (already validated by the caller); returns its stream."""
        stream = RequestStream(f"req-{next(self._ids)}", list(prompt_token_ids))
        self._commands.put(("add", stream, sampling_params))
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    @property
    def num_active(self) -> int:
        return len(self._streams)

    # ------------------------------------------------------------------ the loop thread
    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, stream, params = cmd
                try:
                    self.engine.add_request(stream.prompt_token_ids, params, request_id=stream.request_id)
                    self._streams[stream.request_id] = stream
                except ValueError as e:  # validated before, but never let one request stop the loop
                    stream.put(StreamEvent([], True, "error", str(e)))
            else:
                stream = self._streams.pop(cmd[1], None)
                if stream is not None:
                    self.engine.abort_request(cmd[1])
                    stream.put(StreamEvent([], True, "abort"))

    def _run(self) -> None:
        while not self._stop:
            self._apply_commands()
            if not self.engine.has_unfinished_requests():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                stepped, _ = self.engine.step()
            except Exception:  # fail the requests in flight, keep serving new ones
                message = traceback.format_exc(limit=5)
                for rid, stream in list(self._streams.items()):
                    with contextlib.suppress(Exception):  # the engine may be half-way through a step
                        self.engine.abort_request(rid)
                    stream.put(StreamEvent([], True, "error", message))
                self._streams.clear()
                continue
            for seq in stepped:
                stream = self._streams.get(seq.request_id)
                if stream is None:
                    continue
                stream.put(StreamEvent([seq.token_ids[-1]], seq.is_finished, seq.finish_reason))
                if seq.is_finished:
                    del self._streams[seq.request_id]
