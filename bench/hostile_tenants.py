"""The fuzz bench's `tenants` family: one API key reaching for what another key made, on a server with keys.

The runner's own key (`OWNER`) stores a response and a conversation with an item first; each case then asks for
them, continues, deletes, cancels or lists them as another key, as no key, or as a wrong key, or asks for what only
an admin key may do. Every case must be refused (404 for another key's record, 401 without a valid key, 403 for
an operator's route), and the owner's records must read back whole afterwards.
"""

from __future__ import annotations

from bench.hostile import Case, Expect, encode

OWNER = "owner-key-0123456789"
OTHER = "other-key-0123456789"
ADMIN = "admin-key-0123456789"
WRONG = "wrong-key-0123456789"
NO_KEY = ""
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
        body = (
            {"model": model, "max_output_tokens": 2, **reach}
            if isinstance(reach, dict) and path == "/v1/responses"
            else reach
        )
        for who, key, expect_status in (
            ("another key", OTHER, 404),
            ("no key", NO_KEY, 401),
            ("a wrong key", WRONG, 401),
        ):
            cases.append(
                Case(
                    family="tenants",
                    group=f"{what} ({path})",
                    name=f"{who}: {what} ({method} {path}, expect {expect_status})",
                    method=method,
                    path=path,
                    body=encode(body) if body is not None else None,
                    expect=Expect.REFUSED,
                    credentials=key,
                )
            )
    for who, key in (("another key", OTHER), ("the owner's key", OWNER)):
        cases.append(
            Case(
                family="tenants",
                group="reset the prompt cache",
                name=f"{who}: reset the prompt cache (POST /v1/cache/reset, expect 403)",
                method="POST",
                path="/v1/cache/reset",
                body=None,
                expect=Expect.REFUSED,
                credentials=key,
            )
        )
    return cases
