"""What a request asks of the chat template beyond its messages: `chat_template_kwargs` and a reasoning effort.

`chat_template_kwargs` reach the template as keyword arguments (as vLLM passes them; a key the template does not
read changes nothing). A reasoning effort (chat's `reasoning_effort`, Responses' `reasoning.effort`) maps onto the
template's own switch: `enable_thinking` (Qwen3 and kin: off for "none", on otherwise) and/or a `reasoning_effort`
variable; a template with neither cannot honour it, and the request is refused rather than silently served.

Anthropic's `output_config.effort` is advisory: whether to think is its `thinking` field's, so the effort reaches only
a template's `reasoning_effort` variable, and a template without one is served without it, the effort left out where
a trace shows it (`left_out`). Claude Code sends an effort on every request, and a model that cannot take one must
still serve Claude Code.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
EFFORT_VARIABLE = "reasoning_effort"  # the template variable an effort sets (gpt-oss's: low, medium, high)
# Arguments the renderer sets itself: a request may not replace them.
RESERVED = frozenset(
    {"messages", "tools", "add_generation_prompt", "tokenize", "return_dict", "continue_final_message", "chat_template"}
)


class TemplateOptionRefused(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True, slots=True, kw_only=True)
class TemplateOptions:
    kwargs: tuple[tuple[str, Any], ...] = ()
    reasoning_effort: str | None = None
    effort_param: str = "reasoning_effort"  # how the request named it (Responses: "reasoning.effort")
    effort_advisory: bool = False  # Anthropic's: only a `reasoning_effort` variable takes it, and none is no refusal

    def for_template(self, template: str, thinking: bool) -> dict[str, Any]:
        """The keyword arguments for `template` (its source text), or `TemplateOptionRefused`."""
        arguments = dict(self.kwargs)
        effort = self.reasoning_effort
        if effort is not None and self.effort_advisory:
            if EFFORT_VARIABLE in template:
                arguments[EFFORT_VARIABLE] = effort
        elif effort is not None:
            switches = [name for name in ("enable_thinking", "reasoning_effort") if name in template]
            if not switches:
                raise TemplateOptionRefused(
                    f"'{self.effort_param}' cannot be honoured: this model's chat template has no reasoning switch "
                    "(enable_thinking or reasoning_effort)",
                    self.effort_param,
                )
            if "enable_thinking" in switches:
                arguments["enable_thinking"] = effort != "none"
            if "reasoning_effort" in switches:
                arguments["reasoning_effort"] = effort
        if not thinking:  # the server's own renders that must not think (a compaction summary)
            arguments["enable_thinking"] = False
        return arguments

    def left_out(self, template: str) -> tuple[str, ...]:
        """The request's fields `template` cannot take and that are served without (an advisory effort's)."""
        advisory = self.reasoning_effort is not None and self.effort_advisory
        return (self.effort_param,) if advisory and EFFORT_VARIABLE not in template else ()


NO_OPTIONS = TemplateOptions()


def template_kwargs(value: Any, param: str = "chat_template_kwargs") -> tuple[tuple[str, Any], ...]:
    """`chat_template_kwargs` checked: at most 16 names, each a plain identifier the renderer does not set itself,
    each value a JSON scalar (strings up to 1,024 characters)."""
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise TemplateOptionRefused(f"'{param}' must be an object", param)
    if len(value) > 16:
        raise TemplateOptionRefused(f"'{param}' holds at most 16 entries", param)
    checked: list[tuple[str, Any]] = []
    for name, entry in value.items():
        if not isinstance(name, str) or not name.isidentifier() or name in RESERVED:
            raise TemplateOptionRefused(f"'{param}' cannot set {str(name)[:40]!r}", param)
        if isinstance(entry, str) and len(entry) > 1024:
            raise TemplateOptionRefused(f"'{param}.{name}' is longer than 1024 characters", f"{param}.{name}")
        if not (entry is None or isinstance(entry, str | bool | int | float)):
            message = f"'{param}.{name}' must be a string, number, boolean or null"
            raise TemplateOptionRefused(message, f"{param}.{name}")
        checked.append((name, entry))
    return tuple(checked)


def reasoning_effort(value: Any, param: str) -> str | None:
    if value is None:
        return None
    if value not in REASONING_EFFORTS:
        raise TemplateOptionRefused(f"'{param}' must be one of {', '.join(REASONING_EFFORTS)}", param)
    return str(value)
