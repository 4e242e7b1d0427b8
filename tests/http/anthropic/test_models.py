"""GET /v1/models for both SDKs on one path: the official Anthropic client (it sends `anthropic-version`, its key as
`x-api-key`) gets Anthropic's list and model shapes, paginated; the OpenAI client gets OpenAI's, as before.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest

from tests.http.anthropic.conftest import ALIAS, MODEL
from tests.support.agent_model import CONTEXT_LENGTH
from tests.support.agent_recorder import API_KEY
from tests.support.lazy_modules import lazily
from tests.support.server import RunningServer

if TYPE_CHECKING:
    import anthropic
else:
    anthropic = lazily("anthropic")  # tests/support/lazy_modules.py: not at collection


def openai_models(server: RunningServer) -> list[Any]:
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0) as client:
        return list(client.models.list())


def test_the_anthropic_sdk_lists_the_served_names_in_its_shape(
    messages_client: anthropic.Anthropic, server: RunningServer
) -> None:
    listed = list(messages_client.models.list())
    served = openai_models(server)
    assert [model.id for model in listed] == [model.id for model in served] == [MODEL, ALIAS]
    for model, same in zip(listed, served, strict=True):
        assert (model.type, model.display_name, model.lifecycle) == ("model", model.id, "active")
        assert model.created_at == datetime.fromtimestamp(same.created, UTC)
        assert model.max_input_tokens == CONTEXT_LENGTH


def test_the_anthropic_list_pages_by_cursor(messages_client: anthropic.Anthropic) -> None:
    first = messages_client.models.list(limit=1)
    assert ([model.id for model in first.data], first.has_more, first.first_id, first.last_id) == (
        [MODEL],
        True,
        MODEL,
        MODEL,
    )
    assert [model.id for model in first] == [MODEL, ALIAS]  # the SDK follows after_id to the end
    before = messages_client.models.list(before_id=ALIAS, limit=5)
    assert ([model.id for model in before.data], before.has_more) == ([MODEL], False)
    assert messages_client.models.list(lifecycle=["retired"]).data == []


def test_the_anthropic_sdk_retrieves_a_model_and_a_missing_one_is_not_found(
    messages_client: anthropic.Anthropic,
) -> None:
    model = messages_client.models.retrieve(ALIAS)
    assert (model.type, model.id) == ("model", ALIAS)
    with pytest.raises(anthropic.NotFoundError) as missing:
        messages_client.models.retrieve("nope")
    error: Any = missing.value.body
    assert (error["type"], error["error"]["type"]) == ("error", "not_found_error")
    # The request's id, as Anthropic's SDK reads it from the `request-id` header, is the one the body names.
    assert missing.value.request_id is not None and missing.value.request_id.startswith("req_")
    assert error["request_id"] == missing.value.request_id


@pytest.mark.parametrize(
    ("query", "param"),
    [({"limit": "0"}, "limit"), ({"after_id": "nope"}, "after_id"), ({"lifecycle": "x"}, "lifecycle")],
)
def test_a_bad_page_query_is_a_400_naming_it(
    messages_client: anthropic.Anthropic, query: dict[str, str], param: str
) -> None:
    with pytest.raises(anthropic.BadRequestError) as refused:
        messages_client.models.list(extra_query=query)
    error: Any = refused.value.body
    assert (error["error"]["type"], error["error"]["param"]) == ("invalid_request_error", param)


def test_the_key_and_the_shape_follow_the_anthropic_version_header(server: RunningServer) -> None:
    wrong = anthropic.Anthropic(base_url=server.base_url, api_key="sk-wrong", max_retries=0)
    with wrong, pytest.raises(anthropic.AuthenticationError) as refused:
        wrong.models.list()
    assert refused.value.body["error"]["type"] == "authentication_error"
    by_key = httpx.get(f"{server.base_url}/v1/models", headers={"x-api-key": API_KEY})
    assert by_key.status_code == 401  # x-api-key is Anthropic's header: taken from Anthropic's clients only
    plain = httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    assert plain.json()["object"] == "list" and "has_more" not in plain.json()
