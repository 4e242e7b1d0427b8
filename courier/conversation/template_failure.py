"""A chat template that fails on a request's messages, told as the client can act on it.

A model's chat template (Jinja, run by transformers) refuses what it cannot render: `raise_exception(...)` with the
template author's own sentence ("Conversation roles must alternate user/assistant/..."), or a Python error from deep
inside (`None + str`, a missing key). `template_failure` says which message the template was rendering when it
failed, and why, in a short reason that shows nothing of Jinja: no template source, no `'dict object' has no
attribute`, no exception text of the template's internals.

Which message: Jinja rewrites a template's traceback so its frames (`<template>`) hold the template's own
variables, its loop variable among them; the message at fault is the one a variable of the deepest such frame is,
found by identity in the `messages` the render was given (so two equal messages are told apart). A failure outside
any message (a check on the whole list) names none; so does anything of another shape than expected.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any

from jinja2 import TemplateError, UndefinedError
from jinja2.runtime import Context

# What a template may raise on a request's messages: the request's failure (400). Anything else is a fault (500).
TEMPLATE_ERRORS: tuple[type[Exception], ...] = (TemplateError, TypeError, ValueError, KeyError, RecursionError)
MAX_REASON_CHARS = 200
TEMPLATE_FILENAME = "<template>"  # the file name Jinja gives a template made from a string, as transformers makes it
_MISSING_ATTRIBUTE = re.compile(r"has no attribute '([^']{1,64})'")
_UNDEFINED_NAME = re.compile(r"^'([^']{1,64})' is undefined$")


@dataclass(frozen=True, slots=True, kw_only=True)
class TemplateFailure:
    index: int | None  # the message (in the list the template was given) it failed on; None: not on one message
    reason: str  # short, for the client: the template author's sentence, or what kind of content it choked on


def template_failure(error: BaseException) -> TemplateFailure:
    frames = _frames(error.__traceback__)
    in_template = any(frame.f_code.co_filename == TEMPLATE_FILENAME for frame in frames)
    return TemplateFailure(index=_message_at_fault(frames), reason=_reason(error, in_template=in_template))


_PLAIN_REASONS: tuple[tuple[type[BaseException], str], ...] = (
    (TypeError, "a value in it has a type the template does not handle"),
    (RecursionError, "the template nests too deeply"),
    (TemplateError, "the template cannot run"),  # a syntax or security error: the template itself, not the message
)


def _reason(error: BaseException, *, in_template: bool) -> str:
    if type(error) is TemplateError or not (in_template or isinstance(error, TemplateError)):
        # `raise_exception(...)`: the template's author speaking; or transformers' own check, saying what it wants.
        return _short(str(error)) or "the template refused it"
    if isinstance(error, UndefinedError):
        return _undefined(str(error))
    if isinstance(error, KeyError) and error.args and isinstance(error.args[0], str):
        return _needs_field(_short(error.args[0]))
    return next((reason for kind, reason in _PLAIN_REASONS if isinstance(error, kind)), "the template failed on it")


def _undefined(text: str) -> str:
    """Jinja's `'dict object' has no attribute 'name'` or `'name' is undefined`, in the client's terms."""
    if match := _MISSING_ATTRIBUTE.search(text):
        return _needs_field(match.group(1))
    if match := _UNDEFINED_NAME.match(text):
        return f"it needs '{match.group(1)}', which the request does not give"
    return "it reads a value the request does not give"


def _needs_field(name: str) -> str:
    return f"it needs a '{name}' field this message does not have"


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."


def _message_at_fault(frames: Sequence[FrameType]) -> int | None:
    """The index, in the `messages` the template was given, of a message a variable of the deepest template frame
    is. Given: what the render's context holds, as a template may rebind `messages` (`set messages = messages[1:]`)."""
    try:
        given = next((found for found in map(_given_messages, frames) if found is not None), None)
        for frame in reversed(frames):
            if frame.f_code.co_filename != TEMPLATE_FILENAME:
                continue
            variables = dict(frame.f_locals)
            messages = given if given is not None else variables.get("messages")
            if not isinstance(messages, Sequence):
                continue
            for name, value in variables.items():
                if name == "messages" or not isinstance(value, dict):
                    continue
                for index, message in enumerate(messages):
                    if message is value:
                        return index
    except Exception:  # a Jinja or transformers of another shape: the failure is still told, unnamed
        return None
    return None


def _frames(traceback: TracebackType | None) -> list[FrameType]:
    frames = []
    while traceback is not None:
        frames.append(traceback.tb_frame)
        traceback = traceback.tb_next
    return frames


def _given_messages(frame: FrameType) -> Sequence[Any] | None:
    """The `messages` a Jinja render was called with, from the render's context (Jinja's own `Template.render`)."""
    for value in frame.f_locals.values():
        if isinstance(value, Context):
            messages = value.parent.get("messages")
            return messages if isinstance(messages, Sequence) else None
    return None
