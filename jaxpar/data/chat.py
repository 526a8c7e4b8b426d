"""Conversations and prompt–completion pairs as token ids with a loss mask, rendered by the
tokenizer folder's own chat template (transformers' `apply_chat_template`; jaxpar writes no template).

`Rendered`: the ids of a record, `mask` (1 where the token is a target the loss counts) and
`turn_ends` (the token index just after each assistant turn: where a conversation may be cut
without splitting a turn).

Which tokens are the assistant's:
- a template with `{% generation %}` markers says so itself: transformers' assistant mask
  (`return_assistant_tokens_mask=True`) is the mask;
- otherwise, from the template alone: for assistant message k, the conversation up to k rendered
  with the generation prompt (what a model is given at inference) and the conversation through k
  rendered without it; the tokens between the two are that turn's reply, its end-of-turn token
  included (what a model generates for it, stop included). This needs the template to be
  prefix-stable — each such rendering, tokenized, a prefix of the whole conversation's tokens — and
  a template that is not (one that rewrites earlier turns, as templates that drop earlier "thinking"
  do) is refused for that record in one line.

Prompt–completion pairs (`render_completion`, also what preference pairs reuse: a prompt with a
chosen and with a rejected completion): text — the tokenizer's own special tokens around
prompt + completion (`jaxpar.data.tokenizer.special_tokens`: e.g. BOS in front, EOS last), prompt
and completion tokenized apart so the boundary is exact; messages — the prompt rendered with the
generation prompt, then prompt + completion rendered whole, the tokens after the prompt's the
completion's. The prompt's tokens are masked out, the completion's (its EOS included) count.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np

from jaxpar.data.tokenizer import TextTokenizer

ROLES = ("system", "user", "assistant", "tool")
_GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")


class RecordError(ValueError):
    """A record that cannot be rendered; the message says what, the caller adds the file and line."""


class Rendered(NamedTuple):
    ids: np.ndarray  # int32 [n]
    mask: np.ndarray  # int32 [n]: 1 where the token is a target the loss counts
    turn_ends: tuple[int, ...]  # token index after each assistant turn (a completion: its end)


def chat_tokenizer(encoder):
    """The transformers tokenizer of a document encoder, if it has a chat template; else RecordError."""
    tokenizer = encoder.tokenizer if isinstance(encoder, TextTokenizer) else None
    if tokenizer is None or not tokenizer.chat_template:
        where = "data.tokenizer is empty (bytes)" if tokenizer is None else f"the tokenizer {encoder.name} has no chat template"
        raise RecordError(f"a record of messages needs a chat template to render it, but {where}")
    return tokenizer


def has_generation_markers(tokenizer) -> bool:
    return bool(_GENERATION.search(tokenizer.chat_template or ""))


def check_messages(messages) -> list[dict]:
    """The record's messages, checked: a non-empty list of {"role", "content"} with known roles and
    text content, at least one assistant turn. An assistant turn may call tools instead of (or beside)
    answering — `tool_calls`, a list the template renders, with content null or text — and "tool"
    turns give the results back; only the assistant's tokens (its calls included) are trained."""
    if not isinstance(messages, list) or not messages:
        raise RecordError(f"'messages' must be a non-empty list of {{'role', 'content'}} objects, got {_kind(messages)}")
    for i, message in enumerate(messages):
        calls = isinstance(message, dict) and message.get("role") == "assistant" and "tool_calls" in message
        if not isinstance(message, dict) or "role" not in message or ("content" not in message and not calls):
            raise RecordError(f"message {i} must be an object with 'role' and 'content', got {_kind(message)}")
        if message["role"] not in ROLES:
            raise RecordError(f"message {i} has role {message['role']!r}, not one of {', '.join(ROLES)}")
        if calls:
            if not isinstance(message["tool_calls"], list) or not message["tool_calls"]:
                raise RecordError(f"message {i} (assistant) has tool_calls of type {_kind(message['tool_calls'])}, not a "
                                  "non-empty list")
            if message.get("content") is None or isinstance(message["content"], str):
                continue
        if not isinstance(message["content"], str):
            raise RecordError(f"message {i} ({message['role']}) has content of type {_kind(message['content'])}, not text")
    if not any(m["role"] == "assistant" for m in messages):
        raise RecordError("the conversation has no assistant turn: nothing to train on")
    return messages


def _kind(value) -> str:
    return "null" if value is None else type(value).__name__


def _render(tokenizer, messages, generation_prompt: bool) -> list[int]:
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as e:  # noqa: BLE001 - the template's own raise_exception, or jinja failing on the record
        raise RecordError(f"the chat template fails on it ({type(e).__name__}: {(str(e).splitlines() or [''])[0]})") from None
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _prefix_of(part: list[int], whole: list[int], what: str) -> None:
    if whole[: len(part)] != part:
        raise RecordError(f"the chat template is not prefix-stable: {what} is not a prefix of the whole conversation's "
                          f"tokens, so its assistant tokens cannot be told from the template; use a template with "
                          f"{{% generation %}} markers")


def prefix_mask(tokenizer, messages) -> Rendered:
    """The assistant mask from prefix renderings (module docstring), for any template."""
    ids = _render(tokenizer, messages, False)
    mask, ends = np.zeros(len(ids), np.int32), []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = _render(tokenizer, messages[:k], True) if k else []
        end = _render(tokenizer, messages[: k + 1], False)
        _prefix_of(start, ids, f"the conversation before message {k} with the generation prompt")
        _prefix_of(end, ids, f"the conversation through message {k}")
        mask[len(start) : len(end)] = 1
        ends.append(len(end))
    return Rendered(np.asarray(ids, np.int32), mask, tuple(ends))


def marker_mask(tokenizer, messages) -> Rendered:
    """transformers' assistant mask from the template's `{% generation %}` markers; turns end where
    a run of assistant tokens does."""
    try:
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    except Exception as e:  # noqa: BLE001 - as in `_render`
        raise RecordError(f"the chat template fails on it ({type(e).__name__}: {(str(e).splitlines() or [''])[0]})") from None
    ids, mask = np.asarray(out["input_ids"], np.int32), np.asarray(out["assistant_masks"], np.int32)
    ends = np.flatnonzero(np.diff(np.concatenate([mask, [0]])) < 0) + 1
    return Rendered(ids, mask, tuple(int(e) for e in ends))


def render_conversation(tokenizer, messages) -> Rendered:
    """A conversation's ids and assistant mask (module docstring)."""
    messages = check_messages(messages)
    rendered = marker_mask(tokenizer, messages) if has_generation_markers(tokenizer) else prefix_mask(tokenizer, messages)
    if not rendered.mask.any():
        raise RecordError("the chat template renders no assistant token for it (an empty reply?)")
    return rendered


def render_completion(encoder, prompt, completion) -> Rendered:
    """A prompt–completion pair's ids, the completion's tokens counted (module docstring). `encoder`:
    a `jaxpar.data.tokenizer.TextTokenizer` (or the byte encoder, for text pairs only)."""
    if isinstance(prompt, str) and isinstance(completion, str):
        if not completion:
            raise RecordError("'completion' is empty: nothing to train on")
        before, after = encoder.encode_text(prompt), encoder.encode_text(completion)
        head, tail = list(encoder.prefix), list(encoder.suffix)
        ids = head + before + after + tail
        mask = [0] * (len(head) + len(before)) + [1] * (len(after) + len(tail))
        return Rendered(np.asarray(ids, np.int32), np.asarray(mask, np.int32), (len(ids),))
    if isinstance(prompt, list) and isinstance(completion, list):
        tokenizer = chat_tokenizer(encoder)
        for i, message in enumerate(completion):
            if isinstance(message, dict) and message.get("role") != "assistant":
                raise RecordError(f"completion message {i} has role {message.get('role')!r}; a completion is the assistant's")
        check_messages(prompt + completion)
        start = _render(tokenizer, prompt, True)
        ids = _render(tokenizer, prompt + completion, False)
        _prefix_of(start, ids, "the prompt with the generation prompt")
        mask = np.zeros(len(ids), np.int32)
        mask[len(start) :] = 1
        return Rendered(np.asarray(ids, np.int32), mask, (len(ids),))
    raise RecordError(f"'prompt' and 'completion' must both be text or both be lists of messages, got "
                      f"{_kind(prompt)} and {_kind(completion)}")


__all__ = ["ROLES", "RecordError", "Rendered", "check_messages", "render_completion", "render_conversation"]
