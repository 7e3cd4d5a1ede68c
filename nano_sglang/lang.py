"""The SGLang frontend (arXiv 2312.07104, §2): prompts as programs over a growing program state.

    import nano_sglang as sgl

    @sgl.function
    def qa(s, question):
        s += sgl.system("You are terse.")
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=16))
        forks = s.fork(2)                                   # parallel branches share the prefix
        for i, f in enumerate(forks):
            f += f"Option {i}: " + sgl.gen("opt", max_tokens=8)
        s += "Best: " + sgl.select("best", choices=["A", "B"])

    state = qa.run(question="Why?", backend=sgl.RuntimeBackend(runtime))
    state["answer"], state.text()
    qa.run_batch([{"question": "a"}, {"question": "b"}], backend=...)

Interpreter: every `ProgramState` owns a worker thread and a queue of primitives, so `s += ...` returns at
once and the program runs ahead (asynchronous execution, §2 "Execution modes"); reading a variable
(`s["answer"]`) or `text()` waits for the queue to drain. Many states — batch members, fork branches —
run concurrently, so their requests meet in the same engine steps and the radix tree. A `fork` first
sends the shared prefix ahead as a one-token request (a *hint*), so its KV is cached once before the
branches, which all start with it, arrive (§2, "the interpreter ... sends the prefix first").
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass


@dataclass
class Gen:
    """The `gen` primitive: a generation call whose text lands in variable `name` (§2)."""

    name: str | None
    max_tokens: int = 32
    temperature: float = 0.0
    stop: str | list[str] | None = None
    regex: str | None = None
    json_schema: dict | None = None
    jump_forward: bool = True


@dataclass
class Select:
    """The `select` primitive: the likeliest of `choices` lands in variable `name` (§2)."""

    name: str | None
    choices: list[str]


def gen(name: str | None = None, max_tokens: int = 32, temperature: float = 0.0, stop=None,
        regex=None, json_schema=None, jump_forward: bool = True) -> Gen:
    """Generate into variable `name` (optionally constrained by a regex or JSON schema, §4)."""
    return Gen(name, max_tokens, temperature, stop, regex, json_schema, jump_forward)


def select(name: str | None = None, choices: list[str] | None = None) -> Select:
    """Choose the option with the highest length-normalised prompt log-probability (§2)."""
    if not choices:
        raise ValueError("select needs a non-empty list of choices")
    return Select(name, list(choices))


@dataclass
class _Expr:
    """A concatenation of strings and primitives (what `"x" + gen(...)` builds)."""

    parts: list

    def __add__(self, other):
        return _Expr(self.parts + _parts(other))

    def __radd__(self, other):
        return _Expr(_parts(other) + self.parts)


def _parts(x) -> list:
    if isinstance(x, _Expr):
        return list(x.parts)
    if isinstance(x, (str, Gen, Select)):
        return [x]
    raise TypeError(f"cannot add {type(x).__name__} to a program state")


# `gen(...) + "x"` and `"x" + select(...)` build expressions too
Gen.__add__ = Select.__add__ = lambda self, o: _Expr([self, *_parts(o)])
Gen.__radd__ = Select.__radd__ = lambda self, o: _Expr([*_parts(o), self])


def _role(role: str, content="") -> _Expr:
    """ChatML role markers around `content` (which may contain gen/select)."""
    return _Expr([f"<|im_start|>{role}\n", *_parts(content), "<|im_end|>\n"])


def system(content="") -> _Expr:
    """A system message (ChatML)."""
    return _role("system", content)


def user(content="") -> _Expr:
    """A user message (ChatML)."""
    return _role("user", content)


def assistant(content="") -> _Expr:
    """An assistant message (ChatML); usually holds a `gen` or `select`."""
    return _role("assistant", content)


class ProgramState:
    """The text so far, its variables, and a worker thread that executes queued primitives in order."""

    def __init__(self, backend, text: str = ""):
        self.backend = backend
        self._text = text
        self.vars: dict[str, str] = {}
        self.meta: dict[str, dict] = {}
        # appended parts; join() waits until all have run
        self._queue: queue.Queue[list] = queue.Queue()
        self._error: BaseException | None = None
        self._stream: queue.SimpleQueue[str] = queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True).start()

    # ------------------------------------------------------------------ program-facing API
    def __iadd__(self, other) -> ProgramState:
        self._queue.put(_parts(other))
        return self

    def __getitem__(self, name: str) -> str:
        self.sync()
        return self.vars[name]

    def text(self) -> str:
        self.sync()
        return self._text

    def get_meta_info(self, name: str) -> dict:
        """How the primitive that filled `name` ended (SGLang's meta info): a `gen`'s "finish_reason"
        ("stop"; "length" when max_tokens or max_model_len cut it, so a constrained value may not be a
        whole match yet), a `select`'s "normalized_prompt_logprobs"."""
        self.sync()
        return self.meta[name]

    def sync(self) -> None:
        """Wait until every queued primitive has run; raise the first error one of them raised."""
        self._queue.join()
        if self._error is not None:
            raise self._error

    def fork(self, n: int) -> list[ProgramState]:
        """n branches starting from this state's text; the shared prefix is sent ahead as a cache hint."""
        self.sync()
        self.backend.cache_prefix(self._text)
        return [ProgramState(self.backend, self._text) for _ in range(n)]

    def join(self, forks: list[ProgramState]) -> None:
        """Wait for every branch of a `fork` (their variables are read from the branches)."""
        for f in forks:
            f.sync()

    def text_iter(self) -> Iterator[str]:
        """Stream text as it is produced (each appended string and each generated delta); ends when idle."""
        while True:
            try:
                yield self._stream.get(timeout=0.05)
            except queue.Empty:
                # a part's text is streamed before the part is marked done, so idle + empty is the end
                if self._queue.unfinished_tasks == 0 and self._stream.empty():
                    return

    # ------------------------------------------------------------------ the worker
    def _run(self) -> None:
        while True:
            parts = self._queue.get()
            try:
                if self._error is None:
                    for part in parts:
                        self._execute(part)
            except BaseException as e:  # surfaced to the program at its next sync
                self._error = e
            finally:
                self._queue.task_done()

    def _execute(self, part: str | Gen | Select) -> None:
        if isinstance(part, str):
            self._text += part
            self._stream.put(part)
            return
        if isinstance(part, Gen):
            value, deltas = "", self.backend.generate(self._text, part)
            while True:
                try:
                    delta = next(deltas)
                except StopIteration as end:  # the backend returns how the generation ended
                    meta = {"finish_reason": end.value}
                    break
                value += delta
                self._stream.put(delta)
        else:  # select: the choice whose tokens the model finds likeliest after the text so far
            scores = self.backend.score_choices(self._text, part.choices)
            value = part.choices[max(range(len(scores)), key=scores.__getitem__)]
            self._stream.put(value)
            meta = {"normalized_prompt_logprobs": scores}
        self._text += value
        if part.name:
            self.vars[part.name], self.meta[part.name] = value, meta


class SglFunction:
    """A prompt program (`@function`): run it once on a fresh program state, or many at once."""

    def __init__(self, fn: Callable):
        self.fn = fn
        functools.update_wrapper(self, fn)

    def run(self, *args, backend, **kwargs) -> ProgramState:
        """Run the program on a fresh state over `backend`; returns the state once every primitive ran."""
        state = ProgramState(backend)
        self.fn(state, *args, **kwargs)
        state.sync()
        return state

    def run_batch(self, batch_kwargs: list[dict], backend,
                  num_threads: int = 16) -> list[ProgramState]:
        """Run many programs at once (each in its own thread) so their requests batch in the engine."""
        with ThreadPoolExecutor(max(1, min(num_threads, len(batch_kwargs)))) as pool:
            return list(pool.map(lambda kw: self.run(backend=backend, **kw), batch_kwargs))


def function(fn: Callable) -> SglFunction:
    """`@function`: a prompt program `fn(s, ...)` that appends to the program state `s`."""
    return SglFunction(fn)
