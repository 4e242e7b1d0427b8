"""A `/v1/responses` create, prepared to be planned: the body parsed, checked against the served model, its sealed
reasoning opened and its output constraint compiled. The HTTP route and the WebSocket transport both start here."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from courier.conversation.request import ResponsesRequest
from courier.http.constrained import constrain
from courier.http.context import AppContext
from courier.http.errors import ApiError
from courier.http.responses.items import unsealed
from courier.http.responses.request import parse_responses_request


async def prepared(context: AppContext, body: dict[str, Any]) -> ResponsesRequest:
    """A create's body, parsed, checked against the served model, its sealed reasoning opened and its output
    constraint compiled: what a turn is planned from (over HTTP or the WebSocket alike)."""
    parsed = parse_responses_request(body, context.state.sampling_defaults)
    context.require_ready()
    context.require_model(parsed.model)
    parsed = replace(parsed, input_items=tuple(unsealed(context.seal, parsed.input_items)))
    _require_custom_tool_format(context, parsed)
    sampling = await constrain(context, parsed.sampling, parsed.output, context.caller().tenant)
    return replace(parsed, sampling=sampling)


def _require_custom_tool_format(context: AppContext, parsed: ResponsesRequest) -> None:
    """Custom tools are written in a `json_tools` format (the generic one among them), which Courier can constrain;
    a model whose own format it cannot write cannot be offered them."""
    tool_format = context.state.tool_format
    if parsed.template_tools and (tool_format is None or tool_format.grammar is None):
        for tool in parsed.model_tools:
            if tool.get("type") == "custom":
                message = (
                    f"custom tool {tool['name']!r} cannot be offered: this model's own tool-call format is one "
                    "Courier cannot write free-form input in; offer it as a function"
                )
                raise ApiError.invalid(message, param="tools")
