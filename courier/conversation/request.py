"""What a Responses turn and a compaction are asked for, validated (`http/responses/request.py` parses bodies).

The domain's view of a request: the conversation code plans, renders and records a
turn from these, whatever protocol brought them.
"""

from __future__ import annotations

from dataclasses import dataclass

from courier.conversation.chat_render import chat_tools
from courier.core.template_options import NO_OPTIONS, TemplateOptions
from courier.engine.generation import SamplingParams
from courier.grammar.output_spec import OutputSpec
from courier.storage.records import JsonObject


@dataclass(frozen=True, slots=True, kw_only=True)
class ResponsesRequest:
    model: str | None
    input_items: tuple[JsonObject, ...]
    instructions: str | None
    tools: tuple[JsonObject, ...]  # as given, echoed in the response object
    output: OutputSpec  # text.format, tool_choice, parallel_tool_calls
    sampling: SamplingParams
    max_output_tokens: int | None
    metadata: dict[str, str]
    session: str
    prompt_cache_key: str | None
    user: str | None
    safety_identifier: str | None
    store: bool
    stream: bool
    previous_response_id: str | None
    conversation_id: str | None
    cache_prompt: bool
    compact_threshold: int | None = None  # context_management's automatic compaction
    template_options: TemplateOptions = NO_OPTIONS  # reasoning.effort
    # The tools as the model is offered them (namespaces flattened, hosted tools left out); None: `tools` as given.
    offered_tools: tuple[JsonObject, ...] | None = None
    reasoning_summary: str | None = None  # reasoning.summary: reasoning items carry summary parts
    seal_reasoning: bool = False  # include reasoning.encrypted_content: reasoning items come sealed
    compaction_requested: bool = False  # the input ended with a `compaction_trigger` item: compact, answer nothing

    @property
    def model_tools(self) -> tuple[JsonObject, ...]:
        return self.tools if self.offered_tools is None else self.offered_tools

    @property
    def template_tools(self) -> list[JsonObject] | None:
        """The tools the chat template renders: none when there are none or `tool_choice` is "none"."""
        if not self.model_tools or self.output.tool_choice.mode == "none":
            return None
        return chat_tools(self.model_tools)


@dataclass(frozen=True, slots=True, kw_only=True)
class CompactRequest:
    model: str | None
    input_items: tuple[JsonObject, ...]
    instructions: str | None
    tools: tuple[JsonObject, ...]
    max_output_tokens: int
    keep_tokens: int | None
    session: str
    offered_tools: tuple[JsonObject, ...] | None = None  # as on ResponsesRequest

    @property
    def template_tools(self) -> list[JsonObject] | None:
        tools = self.tools if self.offered_tools is None else self.offered_tools
        return chat_tools(tools) if tools else None
