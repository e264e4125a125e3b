"""Chat and completions answers: usage, vLLM's answer-shaping extras (`Shape`), and the unstreamed and streamed
(server-sent events) bodies built from a request's engine events (`collect`, `sse`)."""

import asyncio
import json
from dataclasses import dataclass

from serve_app import tools as toolcalls

from .errors import ERROR_TYPES, APIError
from .upstream import RouterStream, GroupLease


def _joined(first: dict | None, then: dict | None) -> dict | None:
    """Two completions logprobs objects as one (an echoed prompt's, then the output's)."""
    if first is None or then is None:
        return first or then
    return {key: first[key] + then[key] for key in first}


def _usage(n_prompt: int, n_out: int, cached: int, predicted: dict | None = None) -> dict:
    """OpenAI's usage object; cached_tokens: prompt tokens whose KV came from the prefix cache (the
    prompt is shared by a request's choices: the largest of theirs); predicted: with a prediction, its
    accepted and rejected token counts over the choices."""
    usage = {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
             "prompt_tokens_details": {"cached_tokens": cached}}
    if predicted is not None:
        usage["completion_tokens_details"] = dict(predicted)
    return usage


PREDICTION_COUNTS = ("accepted_prediction_tokens", "rejected_prediction_tokens")


def _add_prediction(total: dict | None, stats: dict | None) -> dict | None:
    """A finished choice's prediction counts (its final event's stats) added to the request's."""
    if total is None:
        return None
    for key in PREDICTION_COUNTS:
        total[key] += (stats or {}).get(key, 0)
    return total


@dataclass
class Shape:
    """vLLM's extras that shape a request's answer, not its generation."""

    as_ids: bool = False
    """return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"."""
    prompt_ids: list[list[int]] | None = None
    """return_token_ids: each choice's prompt ids (its generated ids go beside its text)."""
    prompt_logprobs: bool | list = False
    """prompt_logprobs: the prompt tokens' logprobs are asked for; once the first events came, per choice
    in vLLM's shape."""
    continuous_usage: bool = False
    """stream_options.continuous_usage_stats: usage in every streamed chunk."""
    prediction: bool = False
    """A prediction was given: usage reports its accepted and rejected tokens."""


async def collect(fmt, firsts: list[dict], leases: list[GroupLease], meta: dict, n_prompt: int, chat: bool,
                  answers: list[toolcalls.ChatAnswer] | None = None, echoes: list[tuple[str, dict | None]] | None = None,
                  shape: Shape = Shape()):
    """The unstreamed answer. fmt: what formats logprobs (the ingress: `_format_logprobs`). answers: chat's per-choice message builders (tool calls); echoes:
    completions' per-choice prompt text and its logprobs, put first; shape: vLLM's extras for the answer."""
    cached = [0] * len(leases)
    finals: list[dict] = [{}] * len(leases)

    async def one(c: int, first: dict, events: RouterStream) -> tuple[str, list[int], list | None, str | None]:
        text, ids, ev = [first["text"]], list(first["token_ids"]), first
        lps = list(first["logprobs"]) if "logprobs" in first else None
        while not ev["finished"]:
            ev = await events.next()
            text.append(ev["text"])
            ids += ev["token_ids"]
            if lps is not None:
                lps += ev.get("logprobs", [])
        if ev.get("error"):
            raise APIError(503, ev["error"], code="engine_error")
        cached[c] = ev.get("stats", {}).get("cached_tokens", 0)
        finals[c] = ev.get("stats", {})
        return "".join(text), ids, lps, ev["finish_reason"]

    outputs = await asyncio.gather(*(one(c, f, lease.upstream) for c, (f, lease) in enumerate(zip(firsts, leases))))
    choices = []
    top: dict = {}  # vLLM's response-level extras (chat)
    for c, (text, ids, lps, reason) in enumerate(outputs):
        if chat:
            message, reason = (answers[c] if answers else toolcalls.ChatAnswer(None)).message(text, reason)
            choice = {"index": c, "message": message, "logprobs": fmt._format_logprobs(ids, lps, chat, as_ids=shape.as_ids)}
        else:
            prompt_text, prompt_lps = echoes[c] if echoes else ("", None)
            logprobs = fmt._format_logprobs(ids, lps, chat, offset=len(prompt_text), as_ids=shape.as_ids)
            choice = {"index": c, "text": prompt_text + text, "logprobs": _joined(prompt_lps, logprobs)}
        choice["finish_reason"] = reason
        if shape.prompt_ids is not None:
            choice["token_ids"] = ids
            if chat:
                top["prompt_token_ids"] = shape.prompt_ids[c]
            else:
                choice["prompt_token_ids"] = shape.prompt_ids[c]
        if shape.prompt_logprobs:
            if chat:
                top["prompt_logprobs"] = shape.prompt_logprobs[c]
            else:
                choice["prompt_logprobs"] = shape.prompt_logprobs[c]
        choices.append(choice)
    n_out = sum(len(ids) for _, ids, _, _ in outputs)
    predicted = None
    if shape.prediction:
        predicted = dict.fromkeys(PREDICTION_COUNTS, 0)
        for stats in finals:
            _add_prediction(predicted, stats)
    return {**meta, "object": "chat.completion" if chat else "text_completion", "choices": choices,
            "usage": _usage(n_prompt, n_out, max(cached), predicted), **top}


async def sse(fmt, firsts: list[dict], leases: list[GroupLease], meta: dict, n_prompt: int, chat: bool,
              include_usage: bool, answers: list[toolcalls.ChatAnswer] | None = None,
              echoes: list[tuple[str, dict | None]] | None = None, shape: Shape = Shape()):
    """The streamed answer: chat deltas (text, or tool calls as `answers` find or force them) or
    completions text (after the echoed prompt of `echoes`), then usage and [DONE]. shape: vLLM's extras
    (token ids with the chunks that carry them, the prompt's in each choice's first chunk; usage in every
    chunk)."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    answers = answers or [toolcalls.ChatAnswer(None) for _ in leases]

    offsets = [0] * len(leases)  # completions' text_offset runs on across chunks
    predicted = dict.fromkeys(PREDICTION_COUNTS, 0) if shape.prediction else None
    n_out, cached = 0, 0

    def chunk(c: int, finish: str | None, delta: dict | None = None, text: str = "", lps: dict | None = None,
              ids: list[int] | None = None, first: bool = False) -> str:
        if chat:
            choice = {"index": c, "delta": delta or {}, "logprobs": lps, "finish_reason": finish}
        else:
            choice = {"index": c, "text": text, "logprobs": lps, "finish_reason": finish}
            offsets[c] += len(text)
        top = {}
        if shape.prompt_ids is not None:
            choice["token_ids"] = ids or []
            if first:
                (top if chat else choice)["prompt_token_ids"] = shape.prompt_ids[c]
        if first and shape.prompt_logprobs:
            (top if chat else choice)["prompt_logprobs"] = shape.prompt_logprobs[c]
        if shape.continuous_usage:
            top["usage"] = _usage(n_prompt, n_out, cached, predicted)
        return f"data: {json.dumps({**meta, 'object': obj, 'choices': [choice], **top})}\n\n"

    def logprobs(c: int, ev: dict) -> dict | None:
        return (fmt._format_logprobs(ev["token_ids"], ev["logprobs"], chat, offsets[c], shape.as_ids)
                if "logprobs" in ev else None)

    # One pump per choice feeds a queue, so choices stream as their tokens come, interleaved. The
    # queue is small: a slow client slows the pumps (backpressure), and a client that leaves finds
    # the router requests still going, so they are cancelled.
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(leases))

    async def pump(c: int, ev: dict, events: RouterStream) -> None:
        while True:
            await queue.put((c, ev))
            if ev["finished"]:
                return
            ev = await events.next()

    pumps = [asyncio.ensure_future(pump(c, f, lease.upstream)) for c, (f, lease) in enumerate(zip(firsts, leases))]
    open_choices = len(pumps)
    opened = [False] * len(pumps)  # the choice's first chunk went out (it carries the prompt's extras)
    try:
        for c in range(len(pumps)):
            if chat:
                yield chunk(c, None, {"role": "assistant", "content": ""}, first=True)
                opened[c] = True
            elif echoes:
                yield chunk(c, None, text=echoes[c][0], lps=echoes[c][1], first=True)
                opened[c] = True
        while open_choices:
            c, ev = await queue.get()
            n_out += len(ev["token_ids"])
            ids = ev["token_ids"]
            if ev.get("error"):
                err = {"message": ev["error"], "type": ERROR_TYPES[503], "param": None, "code": "engine_error"}
                yield f"data: {json.dumps({'error': err})}\n\n"
                return
            lps = logprobs(c, ev) if ev.get("logprobs") else None
            if ev["finished"]:
                cached = max(cached, ev.get("stats", {}).get("cached_tokens", 0))
                _add_prediction(predicted, ev.get("stats"))
            if chat:
                # text held back (a tool call being read) still sends its tokens' logprobs (and ids)
                deltas = answers[c].deltas(ev["text"]) or ([{}] if lps or (ids and shape.prompt_ids) else [])
                for i, delta in enumerate(deltas):
                    yield chunk(c, None, delta, lps=lps if i == 0 else None, ids=ids if i == 0 else None)
            elif ev["text"] or lps or (ids and shape.prompt_ids is not None):
                yield chunk(c, None, text=ev["text"], lps=lps, ids=ids, first=not opened[c])
                opened[c] = True
            if ev["finished"]:
                open_choices -= 1
                reason = ev["finish_reason"]
                if chat:
                    deltas, reason = answers[c].end(reason)
                    for delta in deltas:
                        yield chunk(c, None, delta)
                yield chunk(c, reason, first=not opened[c])
                opened[c] = True
        if include_usage:
            usage = _usage(n_prompt, n_out, cached, predicted)
            yield f"data: {json.dumps({**meta, 'object': obj, 'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for t in pumps:
            t.cancel()
        # A choice not finished: the client left mid-stream (or an error event ended it), so cancel
        # its router request. A generator that never started never gets here: see `GroupLease`.
        for lease in leases:
            lease.end(lease.upstream.finished)
