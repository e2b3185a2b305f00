"""The OpenAI Batch API's file formats, in and out, as xsched's own request and results rows.

An input line ``{"custom_id", "method", "url", "body"}`` becomes the request object ``xsched
run`` and ``workload fit`` read (:func:`openai_batch_row`); a prompt's results become one output
line ``{"id", "custom_id", "response": {"status_code", "body": {... "choices" ...}}, "error"}``
(:func:`openai_result_line`), and such a line turns back into the results rows it was made of
(:func:`openai_result_rows`), so ``--resume`` and ``replan`` read what ``run`` wrote. Each
choice keeps xsched's own fields (token ids, latency, ...) under ``"xsched"``. No torch here.
"""

from __future__ import annotations

import hashlib
import warnings
from typing import Any, Sequence

from xsched.errors import UserError

OPENAI_URLS = ("/v1/chat/completions", "/v1/completions")
# OpenAI request fields that would change what is generated, with the values that change nothing:
# a line that sets one otherwise is refused rather than run as if it had not asked.
OPENAI_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "repetition_penalty": (None, 1),
    "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none", "auto"), "functions": (None, []),
    "function_call": (None, "none", "auto"), "response_format": (None, {"type": "text"}), "stream": (None, False),
    "top_logprobs": (None, 0), "best_of": (None, 1), "echo": (None, False),
    "suffix": (None, ""), "min_tokens": (None, 0),
}


def openai_batch_row(obj: dict[str, Any], where: str) -> dict[str, Any]:
    """A line of an OpenAI Batch API input file (``{"custom_id", "method", "url", "body"}``) as
    the request object ``xsched run`` reads, or ``obj`` itself if it is not one.

    ``custom_id`` becomes ``"id"``; a chat body's ``"messages"`` or a completion body's
    ``"prompt"`` (text, fed without the chat template, or token ids) the prompt;
    ``"max_completion_tokens"`` or ``"max_tokens"`` ``"max_new_tokens"``; ``"n"``, ``"stop"``,
    ``"temperature"``, ``"top_p"``, ``"seed"`` and vLLM's ``"top_k"`` (-1: off, xsched's 0)
    keep their names. ``"model"`` and other fields are ignored, except those in
    :data:`OPENAI_NEUTRAL` set to something that would change the output: one-line error.
    """
    if "custom_id" not in obj:
        if "body" in obj and ("url" in obj or "method" in obj):  # (said: no "id", which such a line never has)
            raise UserError(f"{where}: an OpenAI batch line (it has \"body\" and \"url\" or \"method\") needs a "
                            "\"custom_id\": a unique id for the request")
        return obj
    if "body" not in obj:  # (read as an xsched line, it said "id" must be a string, got None)
        raise UserError(f"{where}: an OpenAI batch line (it has \"custom_id\") needs a \"body\": the request")
    url, method, body = obj.get("url"), obj.get("method"), obj.get("body")
    if url is not None and url not in OPENAI_URLS:
        raise UserError(f"{where}: \"url\" {str(url)[:60]!r} is not one xsched runs; use {' or '.join(OPENAI_URLS)}")
    if method not in (None, "POST"):
        raise UserError(f"{where}: \"method\" must be \"POST\", got {str(method)[:20]!r}")
    if not isinstance(body, dict):
        raise UserError(f"{where}: \"body\" must be a JSON object (the request), got {type(body).__name__}")
    for key, neutral in OPENAI_NEUTRAL.items():
        if key in body and body[key] not in neutral:
            raise UserError(f"{where}: body \"{key}\" = {str(body[key])[:40]} is not supported by xsched run; drop "
                            "it")
    row: dict[str, Any] = {"id": obj["custom_id"]}
    asked, completion = body.get("logprobs"), body.get("prompt") is not None
    # chat: true; completions: how many alternatives beside the chosen token, of which xsched gives 0
    wants = (asked is True and not completion) or (completion and type(asked) is int and asked == 0)
    if asked not in (None, False) and not wants:
        raise UserError(f"{where}: body \"logprobs\" = {str(asked)[:20]} is not supported: xsched returns the "
                        "chosen tokens' log-probabilities only (chat: true; completions: 0)")
    if wants:
        row["logprobs"] = True
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        row["prompt_ids"] = prompt
    elif isinstance(prompt, list):
        raise UserError(f"{where}: body \"prompt\" must be one text or one list of token ids (one prompt per line)")
    elif prompt is not None:
        row["prompt"], row["chat_template"] = prompt, False  # a completion continues the text as it is
    if body.get("messages") is not None:
        row["messages"] = [_text_parts(m, where) for m in body["messages"]] \
            if isinstance(body["messages"], list) else body["messages"]
    chat, text = body.get("messages") is not None, body.get("prompt") is not None
    if url is not None and (chat, text) != ((True, False) if url == "/v1/chat/completions" else (False, True)):
        want = "\"messages\"" if url == "/v1/chat/completions" else "\"prompt\""
        raise UserError(f"{where}: a body for {url} takes {want}, and only it; this one has "
                        + (" and ".join(k for k, has in (("\"messages\"", chat), ("\"prompt\"", text)) if has)
                           or "neither"))
    limits = [body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None]
    if len(set(map(repr, limits))) > 1:  # (one message for the file: the same text is warned once)
        warnings.warn("OpenAI batch lines give \"max_completion_tokens\" and a different \"max_tokens\"; xsched takes "
                      "max_completion_tokens, OpenAI's newer field", UserWarning, stacklevel=2)
    if limits:
        row["max_new_tokens"] = limits[0]
    for key in ("n", "stop", "temperature", "top_p", "top_k", "seed"):
        if body.get(key) is not None:
            row[key] = body[key]
    if row.get("top_k") == -1:  # vLLM's "no top-k"
        row["top_k"] = 0
    return row


def _text_parts(message: Any, where: str) -> Any:
    """A chat message whose ``"content"`` is a list of ``{"type": "text", "text"}`` parts, joined
    into one text (other parts, images for instance, are refused); any other message as it is."""
    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        return message
    parts = message["content"]
    if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts):
        raise UserError(f"{where}: a message's \"content\" parts must all be {{\"type\": \"text\", \"text\"}}; "
                        "xsched runs text models")
    return {**message, "content": "".join(p["text"] for p in parts)}


def openai_result_line(custom_id: Any, rows: Sequence[dict[str, Any]], *, model: str, chat: bool,
                       created: int) -> dict[str, Any]:
    """The output line of one request: its results ``rows`` (one per sample, in sample order) as
    the choices of a chat or text completion. Ids derive from ``custom_id`` and the tokens
    generated, so a resumed job writes the lines an uninterrupted one does (``created`` aside),
    and two jobs' outputs for one ``custom_id`` do not share ids unless their tokens agree (from
    ``custom_id`` alone, every job's "a" was batch_req_b297ad24...)."""
    digest = hashlib.sha256(repr((custom_id, [list(r.get("output_ids", ())) for r in rows])).encode()).hexdigest()
    choices, completion = [], 0
    for k, row in enumerate(rows):
        stopped = row.get("stopped_on_eos") or row.get("stop_string") is not None
        reply = {"message": {"role": "assistant", "content": row["text"]}} if chat else {"text": row["text"]}
        own = {key: v for key, v in row.items() if key not in ("id", "text", "prompt_tokens", "tokens", "model")}
        choices.append({"index": k, **reply, "logprobs": _logprobs(row, chat),
                        "finish_reason": "stop" if stopped else "length", "xsched": own})
        completion += row["output_tokens"]
    prompt = rows[0]["prompt_tokens"]
    body = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{digest[:24]}",
            "object": "chat.completion" if chat else "text_completion", "created": created, "model": model,
            "choices": choices,
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}
    return {"id": f"batch_req_{digest[24:48]}", "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": digest[48:], "body": body}, "error": None}


def _logprobs(row: dict[str, Any], chat: bool) -> dict[str, Any] | None:
    """OpenAI's ``logprobs`` of a choice from a results row's ``"logprobs"`` and ``"tokens"`` (the
    output tokens' texts; their ids where the model has no tokenizer), or None without them."""
    values = row.get("logprobs")
    if values is None:
        return None
    tokens = row.get("tokens") or [str(t) for t in row["output_ids"]]
    if chat:
        return {"content": [{"token": t, "logprob": v, "bytes": list(t.encode("utf-8", "surrogateescape")),
                             "top_logprobs": []} for t, v in zip(tokens, values)]}
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": list(tokens), "token_logprobs": list(values), "top_logprobs": None, "text_offset": offsets}


def openai_result_rows(obj: dict[str, Any], where: str) -> list[dict[str, Any]] | None:
    """The results rows an output line of :func:`openai_result_line` was made of, or None if
    ``obj`` is no OpenAI output line; a one-line error for one without xsched's fields."""
    if "custom_id" not in obj or "response" not in obj:
        return None
    try:
        body = obj["response"]["body"]
        rows = []
        for choice in body["choices"]:
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            rows.append({"id": obj["custom_id"], "text": text, "prompt_tokens": body["usage"]["prompt_tokens"],
                         **({"model": body["model"]} if isinstance(body.get("model"), str) else {}),
                         **choice["xsched"]})
        return rows
    except (KeyError, TypeError):
        raise UserError(f"{where}: an OpenAI batch output line that xsched did not write (its choices lack "
                        "\"xsched\"); pass another --out") from None
