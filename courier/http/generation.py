"""From a validated request to an admitted generation.

`admit` checks the server is ready and serves the named model, then asks the
ingress (a refusal raises before any byte of the response is sent). Reading the
events is `messages/generation_reader.py`'s business.
"""

from __future__ import annotations

import time
import uuid

from courier.engine.generation import RequestId
from courier.http.constrained import constrain
from courier.http.context import AppContext
from courier.http.model_leases import hold_generation
from courier.http.openai_requests import GenerationRequest
from courier.messages.asking import call
from courier.messages.ingress import AdmitGeneration, Admitted


def new_request_id() -> RequestId:
    return RequestId(uuid.uuid4().hex)


async def admit(
    context: AppContext,
    request: GenerationRequest,
    request_id: RequestId,
    tenant: str | None = None,
    *,
    deadline: float | None = None,
    continuing: bool = False,
) -> Admitted:
    """`tenant`: the caller's, read before a stream began (after the view returned, the request is gone).
    `deadline` (`time.monotonic()`): by when it ends, `--request-timeout` from now unless given. `continuing`: a
    further generation of a request already in flight (a message's answer after its thinking budget), which a
    draining server lets finish as it lets that request finish."""
    if not continuing:
        context.require_ready()
    context.require_model(request.model)
    tenant = context.caller().tenant if tenant is None else tenant
    sampling = await constrain(context, request.sampling, request.output, tenant, continuing=continuing)
    admitted = await call(
        context.outboxes.ingress,
        lambda reply: AdmitGeneration(
            request_id=request_id,
            prompt=request.prompt,
            sampling=sampling,
            reply=reply,
            session=request.session,
            cache_prompt=request.cache_prompt,
            tenant=tenant,
            n=request.n,
            deadline=time.monotonic() + context.settings.request_timeout if deadline is None else deadline,
            fit_to_context=request.fit_to_context,
        ),
    )
    hold_generation(admitted)  # its events closed when the request ends, however it ends
    return admitted
