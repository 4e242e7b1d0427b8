"""The tenants family: one API key reaching for what another key made, on a server with keys. The runner's own key
(`OWNER`) stores a response and a conversation with an item first; each case asks for them as another key, no key
or a wrong key (404, 401, 401), or for an admin's route (403); the owner's records must read back whole after."""

from __future__ import annotations

from dataclasses import replace

from bench.hostile.cases import Case, Expect, encode

OWNER, OTHER, ADMIN, WRONG = (
    "owner-key-0123456789",
    "other-key-0123456789",
    "admin-key-0123456789",
    "wrong-key-0123456789",
)
FLAGS = ("--api-key", f"{OWNER},{OTHER}", "--admin-api-key", ADMIN)
# (what, method, path, body): each reaches for the owner's records ({response}, {conversation}, {item})
REACHES: list[tuple[str, str, str, object]] = [
    ("read the response", "GET", "/v1/responses/{response}", None),
    ("list its input items", "GET", "/v1/responses/{response}/input_items", None),
    ("cancel it", "POST", "/v1/responses/{response}/cancel", None),
    ("delete it", "DELETE", "/v1/responses/{response}", None),
    ("continue it", "POST", "/v1/responses", {"input": "And?", "previous_response_id": "{response}"}),
    ("read the conversation", "GET", "/v1/conversations/{conversation}", None),
    ("list its items", "GET", "/v1/conversations/{conversation}/items", None),
    ("read an item", "GET", "/v1/conversations/{conversation}/items/{item}", None),
    ("add an item", "POST", "/v1/conversations/{conversation}/items", {"items": [{"role": "user", "content": "x"}]}),
    ("delete an item", "DELETE", "/v1/conversations/{conversation}/items/{item}", None),
    ("update it", "POST", "/v1/conversations/{conversation}", {"metadata": {"owner": "me"}}),
    ("delete it", "DELETE", "/v1/conversations/{conversation}", None),
    ("continue it", "POST", "/v1/responses", {"input": "And?", "conversation": "{conversation}"}),
]


def tenant_cases(model: str) -> list[Case]:
    cases = []
    for what, method, path, reach in REACHES:
        turn = (
            {"model": model, "max_output_tokens": 2, **reach} if isinstance(reach, dict) and "input" in reach else reach
        )
        body = encode(turn) if turn is not None else None
        for who, key, status in (("another key", OTHER, 404), ("no key", "", 401), ("a wrong key", WRONG, 401)):
            name, group = f"{who}: {what} ({method} {path}, expect {status})", f"{what} ({path})"
            case = Case(family="tenants", group=group, name=name, path=path, body=body, expect=Expect.REFUSED)
            cases.append(replace(case, method=method, credentials=key))
    for who, key in (("another key", OTHER), ("the owner's key", OWNER)):
        name = f"{who}: reset the prompt cache (POST /v1/cache/reset, expect 403)"
        case = Case(
            family="tenants",
            group="reset the prompt cache",
            name=name,
            path="/v1/cache/reset",
            body=None,
            expect=Expect.REFUSED,
        )
        cases.append(replace(case, credentials=key))
    return cases
