"""The LLMEngine is not thread-safe, so one dedicated thread owns it: it drains a queue of commands
(add, abort, stop), runs `step()` while there is work, and hands each request's progress back to
the asyncio loop that asked for it. Requests from every client join the same running batch."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from flashdraft.engine.engine import LLMEngine
from flashdraft.engine.sequence import Output, Sequence, TokenLogprob
from flashdraft.sampling_params import SamplingParams
from flashdraft.server.errors import APIError

log = logging.getLogger(__name__)


@dataclass
class Update:
    text: str  # text new since the previous update
    finished: bool = False
    output: Output | None = None  # on the final update
    error: BaseException | None = None  # the engine failed; the request is gone
    # with SamplingParams.logprobs: the entries of the tokens whose text this update completes (the final
    # update: every token left, those of a stop string too); with prompt_logprobs, a stream's first update
    # carries the prompt's
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


class RequestStream:
    """One request as its HTTP handler sees it. `seq`, `shown`, `num_seen` and `num_sent` belong to the
    engine thread; the handler only reads `queue`."""

    def __init__(self, request_id: str, streaming: bool):
        self.request_id = request_id
        self.streaming = streaming
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Update] = asyncio.Queue()
        self.seq: Sequence | None = None
        self.shown = ""
        self.num_seen = 0
        self.num_sent = 0  # output tokens whose log-probabilities went out
        self.abort_requested = False
        self.done = False  # the handler has seen the final update
        self.added: asyncio.Future | None = None  # resolved once the engine thread has added the request
        self.ended = False  # the loop side gave it its final update (AsyncEngine.end_stranded)

    def push(self, update: Update) -> None:
        _call_in_loop(self.loop, self.queue.put_nowait, update)

    async def updates(self) -> AsyncIterator[Update]:
        while not self.done:
            u = await self.queue.get()
            self.done = u.finished
            yield u

    async def final(self) -> Update:
        """Wait for the end; returns the final update with the whole text."""
        async for u in self.updates():
            if u.finished:
                return u
        raise RuntimeError("request stream ended twice")


def _call_in_loop(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass  # that loop is closed: nobody is listening any more


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", type="server_error")


def _resolve(fut: asyncio.Future, error: BaseException | None) -> None:
    if fut.done():  # the caller was cancelled meanwhile
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)


def visible_text(text: str, stops: list[str]) -> str:
    """The part of an unfinished request's text that is safe to stream: without a trailing
    incomplete UTF-8 sequence, and without a tail that may turn into a stop string (which the final
    text will not contain)."""
    text = text.rstrip("\ufffd")
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return text[: len(text) - hold]


_shared: weakref.WeakKeyDictionary[LLMEngine, AsyncEngine] = weakref.WeakKeyDictionary()
_shared_lock = threading.Lock()


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[int, RequestStream] = {}
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._users = 0
        self._finished: dict[str, int] = {}
        self._prompt_tokens = 0
        self._handed_out: weakref.WeakSet[RequestStream] = weakref.WeakSet()  # loop side (end_stranded)
        self.snapshot = self._take_snapshot()

    @classmethod
    def of(cls, engine: LLMEngine) -> AsyncEngine:
        """The one AsyncEngine of `engine`: two loop threads on one engine would corrupt it."""
        with _shared_lock:
            if engine not in _shared:
                _shared[engine] = cls(engine)
            return _shared[engine]

    # ---- lifecycle ------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        with self._lock:
            if not self.alive:
                self._thread = threading.Thread(target=self._run, name="flashdraft-engine", daemon=True)
                self._thread.start()

    def acquire(self) -> None:
        """An app starts using the engine (apps may share one engine)."""
        with self._lock:
            self._users += 1
        self.start()

    def release(self) -> None:
        """An app is done; the last one stops the thread, aborting whatever is still running."""
        with self._lock:
            self._users -= 1
            last = self._users <= 0
        if last:
            self.stop()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread after the step it is in; waits up to `timeout` s for that step (the thread is a
        daemon: a process exiting meanwhile does not wait for it)."""
        with self._lock:
            thread = self._thread
        if thread is not None and thread.is_alive():
            self._inbox.put(("stop",))
            thread.join(timeout)
            if thread.is_alive():
                log.warning("the engine thread is still in a step %g s after the stop: leaving it", timeout)

    # ---- called from asyncio --------------------------------------------------------------------
    async def add(self, make_ids: Callable[[LLMEngine], list[int]], params: SamplingParams, request_id: str,
                  streaming: bool) -> RequestStream:
        """Queue a request. `make_ids(engine)` runs on the engine thread (tokenizing is an engine call);
        its exceptions and add_request's (ValueError for a bad prompt) are raised here."""
        self.start()
        stream = RequestStream(request_id, streaming)
        fut = stream.added = stream.loop.create_future()
        self._handed_out.add(stream)
        self._inbox.put(("add", stream, make_ids, params, fut))
        try:
            await fut
        except asyncio.CancelledError:
            self.abort(stream)
            raise
        return stream

    def abort(self, stream: RequestStream) -> None:
        """Finish the request and free its KV pages; a no-op once it has finished."""
        if not stream.done:
            stream.abort_requested = True
            self._inbox.put(("abort", stream))

    def abort_all(self) -> None:
        """Finish every request (they end with finish_reason "abort"); used when shutting down."""
        self._inbox.put(("abort_all",))

    def end_stranded(self) -> None:
        """Shutting down, with the engine thread still inside a step (a long CPU prefill chunk) when the server
        must answer: end, from the loop, every request the engine has not ended yet, as an abort (a request
        not yet added: a 503), so that each handler still answers with its 503 or its `finish_reason:
        "abort"` chunk before the server cancels what is left. The engine's own final update, if it comes
        later, goes unread. Called on the server's loop: it ends that loop's requests (apps on other loops that
        share the engine end theirs themselves)."""
        loop = asyncio.get_running_loop()
        for stream in [s for s in list(self._handed_out) if s.loop is loop]:
            if stream.added is not None and not stream.added.done():
                stream.added.set_exception(shutting_down())
            elif not (stream.done or stream.ended) and stream.seq is not None:
                stream.ended, seq = True, stream.seq
                ids, n = list(seq.token_ids), seq.num_prompt_tokens  # (a copy, taken while the thread steps)
                out = Output(stream.request_id, None, ids[:n], stream.shown, ids[n:], "abort")
                stream.queue.put_nowait(Update("", True, out))

    async def reset_prefix_cache(self) -> None:
        """Forget the prefix cache, on the engine thread between two steps (pages held by running
        requests stay theirs)."""
        self.start()
        fut = asyncio.get_running_loop().create_future()
        self._inbox.put(("reset_prefix_cache", fut))
        await fut

    # ---- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        log.debug("engine thread started")
        while True:
            cmds = [] if self.engine.has_unfinished() else [self._inbox.get()]
            while True:
                try:
                    cmds.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            for cmd in cmds:
                if cmd[0] == "stop":
                    self._shutdown()
                    return
                try:
                    self._handle(cmd)
                except Exception:
                    log.exception("engine command %r failed", cmd[0])
            # whatever fails here, the thread must live on: a dead loop would hang every request
            try:
                if self.engine.has_unfinished():
                    self.engine.step()
                self._publish()
            except Exception as e:
                log.exception("engine step failed; failing all running requests")
                self._fail_all(e)
            self.snapshot = self._take_snapshot()

    def _handle(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, stream, make_ids, params, fut = cmd
            try:
                ids = make_ids(self.engine)
                seq = self.engine.add_request(None, params, stream.request_id, prompt_token_ids=ids)
            except Exception as e:
                _call_in_loop(stream.loop, _resolve, fut, e)
                return
            stream.seq = seq
            self._streams[seq.seq_id] = stream
            if stream.abort_requested:
                self.engine.abort(seq)
            _call_in_loop(stream.loop, _resolve, fut, None)
        elif cmd[0] == "abort":
            seq = cmd[1].seq
            if seq is not None and not seq.is_finished:
                self.engine.abort(seq)
        elif cmd[0] == "reset_prefix_cache":
            self.engine.reset_prefix_cache()
            _call_in_loop(cmd[1].get_loop(), _resolve, cmd[1], None)
        elif cmd[0] == "abort_all":
            for stream in self._streams.values():
                self.engine.abort(stream.seq)

    def _publish(self) -> None:
        for sid, stream in list(self._streams.items()):
            seq = stream.seq
            if seq.is_finished:
                del self._streams[sid]
                out = self.engine.output(seq)
                if seq.finish_reason == "abort":  # abort() leaves seq.text empty
                    out.text = self.engine.detokenize(seq)
                delta = out.text[len(stream.shown):] if out.text.startswith(stream.shown) else ""
                stream.push(self._update(stream, seq, delta, seq.num_output_tokens, out))
                self._finished[seq.finish_reason] = self._finished.get(seq.finish_reason, 0) + 1
                self._prompt_tokens += seq.num_prompt_tokens
            elif stream.streaming and seq.num_output_tokens != stream.num_seen:
                stream.num_seen = seq.num_output_tokens
                full = self.engine.detokenize(seq)
                text = visible_text(full, seq.params.stops)
                if len(text) > len(stream.shown) and text.startswith(stream.shown):
                    whole = seq.num_output_tokens if text == full else self._num_shown_tokens(stream, seq, text)
                    stream.push(self._update(stream, seq, text[len(stream.shown):], whole))
                    stream.shown = text

    def _num_shown_tokens(self, stream: RequestStream, seq: Sequence, shown: str) -> int:
        """How many output tokens `shown` holds whole: up to the last whose prefix decodes to a prefix of it
        (a token part of which is held back goes out with the rest of its text)."""
        if seq.logprobs is None:
            return stream.num_sent
        ids, skip = seq.output_token_ids, seq.params.skip_special_tokens
        return next((j for j in range(len(ids) - 1, stream.num_sent, -1)
                     if shown.startswith(self.engine.tokenizer.decode(ids[:j], skip_special_tokens=skip))),
                    stream.num_sent)

    @staticmethod
    def _update(stream: RequestStream, seq: Sequence, text: str, end: int, out: Output | None = None) -> Update:
        """An update of `text` (the final one with `out`) with the log-probabilities of output tokens
        [num_sent, end), and on a stream's first update the prompt's."""
        logprobs = None
        if seq.logprobs is not None:
            logprobs, stream.num_sent = seq.logprobs[stream.num_sent:end], end
        prompt_logprobs = None if stream.shown or seq.prompt_logprobs is None else list(seq.prompt_logprobs)
        return Update(text, out is not None, out, logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            try:
                self.engine.abort(stream.seq)
            except Exception:
                log.exception("abort after a failed step failed too")
            stream.push(Update("", True, error=error))
        self._streams.clear()

    def _shutdown(self) -> None:
        for stream in self._streams.values():
            self.engine.abort(stream.seq)
        self._publish()
        while True:  # requests queued behind the stop: refuse them rather than leave them hanging
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                _call_in_loop(cmd[1].loop, _resolve, cmd[4], shutting_down())
        self.snapshot = self._take_snapshot()
        log.debug("engine thread stopped")

    def _take_snapshot(self) -> dict:
        """Engine counters for /metrics, copied here so that scrapes never touch the engine."""
        e = self.engine
        spec = dict(e.spec_totals())
        spec["accepted_per_position"] = list(spec.get("accepted_per_position", []))
        return {"running": len(e.scheduler.running), "waiting": len(e.scheduler.waiting),
                "kv_used_blocks": e.block_manager.num_used_blocks, "kv_total_blocks": e.block_manager.num_blocks,
                "stats": dict(e.stats), "spec": spec, "finished": dict(self._finished),
                "prompt_tokens": self._prompt_tokens, "prefix_cache_queries": e.block_manager.num_queried_tokens,
                "prefix_cache_hits": e.block_manager.num_hit_tokens}
