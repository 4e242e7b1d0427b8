"""API keys: every route but `/health` asks for one; with keys, a tenant's records and cache state are its own.

The route table is checked in-process over every rule the app serves (a route added
later is covered by construction). Scoping is checked end to end on a real server
with the official openai client: another key's stored responses and conversations
are 404, its prompt-cache state is never reused, and only an admin key resets the
cache.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest
from quart.typing import TestClientProtocol as QuartClient

from courier.conversation.capsule import CapsuleCodec
from courier.http.app import create_quart_app
from courier.http.auth import ApiKeys, Caller
from courier.http.context import AppContext, Outboxes
from courier.platform.blas import BlasReport
from courier.settings import Settings
from courier.status.metrics import CourierMetrics
from courier.status.scheduler_stats import SchedulerStats
from courier.status.service_state import ServiceState
from tests.support.server import RunningServer, serving

MODEL = "tiny-llama"
KEY, OTHER_KEY, ADMIN_KEY = "sk-courier-one", "sk-courier-two", "sk-courier-admin"
STORAGE_BYTES = 1_200_000  # shared evenly by the three keys: 400 KB each
BIG_TEXT = "x" * 300_000
BLAS = BlasReport(library="reference", path=None, optimized=False, detail="test")


# -- the route table, in-process ---------------------------------------------------------------------------------------


@pytest.fixture
async def app(request: pytest.FixtureRequest) -> AsyncIterator[tuple[QuartClient, list[tuple[str, str]]]]:
    settings = replace(Settings(), public_metrics=getattr(request, "param", False))
    state = ServiceState(blas=BLAS, model_id="tiny", scheduler=SchedulerStats(max_batch=1, max_queue=1))
    streams = [anyio.create_memory_object_stream[Any](1) for _ in range(4)]
    for _, receive in streams:
        receive.close()  # no actor runs here: a route that asks one answers 503 at once
    outboxes = Outboxes(
        token_counter=streams[0][0], ingress=streams[1][0], storage=streams[2][0], compactor=streams[3][0]
    )
    context = AppContext(
        settings=settings,
        state=state,
        outboxes=outboxes,
        metrics=CourierMetrics(state),
        capsules=CapsuleCodec(None, settings.max_body_bytes),
        api_keys=ApiKeys([KEY], [ADMIN_KEY]),
    )
    quart = create_quart_app(context)
    routes = sorted(
        {
            (method, re.sub(r"<(?:[a-z]+:)?([a-z_]+)>", r"\1_x", rule.rule))
            for rule in quart.url_map.iter_rules()
            for method in rule.methods or ()
            if method not in ("HEAD", "OPTIONS")
        }
    )
    yield quart.test_client(), routes
    for send, receive in streams:
        send.close()
        receive.close()


@pytest.mark.anyio
async def test_every_route_but_health_needs_a_key(app: tuple[QuartClient, list[tuple[str, str]]]) -> None:
    client, routes = app
    assert len(routes) > 30  # every API family is there
    for method, path in routes:
        if path == "/health":
            continue
        messages_api = path.startswith("/v1/messages")  # Anthropic's clients send x-api-key
        wrong = {"X-Api-Key": "sk-wrong"} if messages_api else {"X-Api-Key": KEY}
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": KEY}, wrong):
            reply = await client.open(path, method=method, headers=headers, json={})
            assert reply.status_code == 401, (method, path, headers)
            body = await reply.get_json()
            assert body["error"]["code"] == "invalid_api_key"
            assert reply.headers["WWW-Authenticate"] == "Bearer"
        accepted = await client.open(path, method=method, headers={"Authorization": f"Bearer {KEY}"}, json={})
        assert accepted.status_code != 401, (method, path)  # a 503 (loading), a 400, ...: the key was accepted
        if messages_api:
            accepted = await client.open(path, method=method, headers={"X-Api-Key": KEY}, json={})
            assert accepted.status_code != 401, (method, path)
    assert (await client.get("/health")).status_code == 503  # loading: its answer, without a key
    assert (await client.get("/no/such/route")).status_code == 401  # no probing for routes without a key


@pytest.mark.anyio
@pytest.mark.parametrize("app", [True], indirect=True)
async def test_public_metrics_answer_without_a_key(app: tuple[QuartClient, list[tuple[str, str]]]) -> None:
    client, _ = app
    assert (await client.get("/metrics")).status_code == 200
    assert (await client.get("/v1/models")).status_code == 401


def test_keys_are_compared_by_digest_and_name_their_tenant() -> None:
    keys = ApiKeys([KEY, OTHER_KEY], [ADMIN_KEY])
    one, two, admin = (keys.caller(f"Bearer {key}") for key in (KEY, OTHER_KEY, ADMIN_KEY))
    assert len({one.tenant, two.tenant, admin.tenant}) == 3
    assert KEY not in one.tenant and len(one.tenant) == 16
    assert (one.admin, two.admin, admin.admin) == (False, False, True)
    assert keys.caller(f"bearer  {KEY} ") == one  # the scheme is case-insensitive; spaces around the key dropped
    assert ApiKeys([]).caller(None) == Caller(tenant="", admin=True)  # no keys: everyone, anonymous


# -- scoping, end to end -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, cache_dir: Path) -> Iterator[RunningServer]:
    keys = ("--api-key", f"{KEY},{OTHER_KEY}", "--admin-api-key", ADMIN_KEY)
    with serving(tiny_llama_dir, cache_dir, MODEL, *keys, "--storage-max-bytes", str(STORAGE_BYTES)) as running:
        yield running


def client(server: RunningServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)


def test_a_wrong_key_is_an_authentication_error(server: RunningServer) -> None:
    with client(server, "sk-nobody") as nobody, pytest.raises(openai.AuthenticationError) as refused:
        nobody.models.list()
    assert refused.value.code == "invalid_api_key"
    with client(server, KEY) as known:
        assert known.models.list().data[0].id == MODEL
    assert httpx.get(f"{server.base_url}/health").json()["status"] == "ok"


def test_another_keys_responses_and_conversations_are_not_there(server: RunningServer) -> None:
    with client(server, KEY) as mine, client(server, OTHER_KEY) as theirs:
        check_scoping(mine, theirs)


def check_scoping(mine: openai.OpenAI, theirs: openai.OpenAI) -> None:
    conversation = mine.conversations.create(items=[{"role": "user", "content": "My secret is 42."}])
    stored = mine.responses.create(model=MODEL, input="Remember it.", max_output_tokens=2)
    assert mine.responses.retrieve(stored.id).id == stored.id
    assert mine.conversations.retrieve(conversation.id).id == conversation.id
    with pytest.raises(openai.NotFoundError):
        theirs.responses.retrieve(stored.id)
    with pytest.raises(openai.NotFoundError):
        theirs.conversations.retrieve(conversation.id)
    with pytest.raises(openai.NotFoundError):
        theirs.conversations.items.list(conversation.id)
    with pytest.raises(openai.NotFoundError):  # nor continue it
        theirs.responses.create(model=MODEL, previous_response_id=stored.id, input="And?", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):  # nor delete it
        theirs.responses.delete(stored.id)
    assert mine.responses.retrieve(stored.id).id == stored.id  # still there for its owner


def test_another_keys_prompt_cache_state_is_never_reused(server: RunningServer) -> None:
    long_system = "You are the support desk of a shop that sells lighthouse models. " * 20
    messages: Any = [{"role": "system", "content": long_system}, {"role": "user", "content": "Hello?"}]

    def cached(key: str) -> int:
        with client(server, key) as caller:
            reply = caller.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        return reply.usage.prompt_tokens_details.cached_tokens or 0

    cached(KEY)
    assert cached(KEY) > 0  # the same key reuses its own state
    assert cached(OTHER_KEY) == 0  # another key's state is not even looked at: no oracle of what others sent


def test_only_an_admin_key_resets_the_prompt_cache(server: RunningServer) -> None:
    forbidden = httpx.post(f"{server.base_url}/v1/cache/reset", headers={"Authorization": f"Bearer {KEY}"})
    assert forbidden.status_code == 403
    assert forbidden.json()["error"]["code"] == "insufficient_permissions"
    reset = httpx.post(f"{server.base_url}/v1/cache/reset", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert reset.status_code == 200 and reset.json()["cleared"] is True


def test_a_key_writing_past_its_share_evicts_only_its_own_records(server: RunningServer) -> None:
    with client(server, KEY) as mine, client(server, OTHER_KEY) as theirs:
        stored = mine.responses.create(model=MODEL, input="Keep this.", max_output_tokens=2)
        conversation = mine.conversations.create(items=[{"role": "user", "content": "And this."}])
        big = [theirs.conversations.create(items=[{"role": "user", "content": BIG_TEXT}]) for _ in range(4)]
        for evicted in big[:3]:  # each took the other key past its 400 KB share: its own older ones went
            with pytest.raises(openai.NotFoundError):
                theirs.conversations.retrieve(evicted.id)
        assert theirs.conversations.retrieve(big[3].id).id == big[3].id
        assert mine.responses.retrieve(stored.id).id == stored.id  # nothing of this key's was touched
        assert mine.conversations.retrieve(conversation.id).id == conversation.id

        with pytest.raises(openai.BadRequestError) as refused:  # larger than its whole share: refused, evicts nothing
            theirs.conversations.create(items=[{"role": "user", "content": "x" * 450_000}])
        assert refused.value.code == "storage_budget_exceeded"
        assert "this API key's storage budget of 400000" in refused.value.message
        assert theirs.conversations.retrieve(big[3].id).id == big[3].id


def test_the_access_log_names_a_caller_by_its_tenant_never_by_its_key(server: RunningServer) -> None:
    """A streamed answer and a refusal, each found in the log by the trace its request carried."""
    streamed, refused = secrets.token_hex(16), secrets.token_hex(16)
    messages: Any = [{"role": "user", "content": "Say something."}]
    with client(server, KEY) as mine:
        chunks = mine.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, stream=True, extra_headers=traced(streamed)
        )
        assert list(chunks)
        with pytest.raises(openai.BadRequestError) as refusal:
            mine.chat.completions.create(
                model=MODEL, messages=messages, presence_penalty=9, extra_headers=traced(refused)
            )
    tenant = ApiKeys([KEY]).caller(f"Bearer {KEY}").tenant
    line = server.logged(re.compile(rf"courier\.access: (.*trace={streamed}.*)")).group(1)
    assert "method=POST path=/v1/chat/completions status=200 " in line, line
    assert f" tenant={tenant} model={MODEL} " in line and "complete=false" not in line, line
    line = server.logged(re.compile(rf"courier\.access: (.*trace={refused}.*)")).group(1)
    assert " status=400 " in line and " param=presence_penalty " in line, line
    assert f" id={refusal.value.request_id} " in line, line  # the id the openai SDK reports
    assert "message=\"'presence_penalty' must be in [-2, 2]\"" in line, line
    assert KEY not in server.log() and "Say something" not in server.log()


def traced(trace_id: str) -> dict[str, str]:
    return {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}
