"""Sends hostile cases to one server and judges each answer: the fuzz bench's second phase."""

from __future__ import annotations

import argparse
import json
import re
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.harness.report import progress
from bench.harness.servers import Server
from bench.hostile import all_families
from bench.hostile import cases as hostile
from bench.hostile.cases import Case, Expect, FollowUp

SHOWN_CHARS = 600
LOG_HEAD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (\w+) ")
TRACE = re.compile(r"\(trace ([0-9a-f]{32})\)")
# A summary cut by max_output_tokens: random weights never end one. A documented 4xx, counted apart and never a
# surprise, even where the generator expected the compaction to be accepted.
DOCUMENTED_FAILURES = {(422, "compaction_failed")}
SETTLE_S = 30.0


@dataclass(slots=True, kw_only=True)
class Answer:
    """One request sent and what came back; `problem` is a failed check, `surprise` an unexpected but sound
    answer."""

    case: str
    method: str
    path: str
    request: str  # the body's start: with the case's name and the seed, enough to find the generator's input
    request_bytes: int
    expect: str
    status: int | None = None
    code: str | None = None
    response: str = ""
    seconds: float = 0.0
    problem: str | None = None
    surprise: str | None = None
    trace: str = ""  # sent as traceparent: the server's log names it beside each error
    log: list[str] = field(default_factory=list)

    @property
    def outcome(self) -> str:
        if self.status is None:
            return "timeout" if self.problem and self.problem.startswith("timeout") else "connection error"
        return str(self.status)

    def must_succeed(self) -> Answer:
        """A refusal here is a problem, not a surprise: what a case left behind broke an ordinary request."""
        if self.surprise is not None:
            self.problem, self.surprise = self.surprise, None
        return self


@dataclass(slots=True, kw_only=True)
class Health:
    alive: bool
    status: int | None = None
    running: int | None = None
    waiting: int | None = None
    chat_status: int | None = None
    image_chat_status: int | None = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        idle = self.running == 0 and self.waiting == 0
        image_ok = self.image_chat_status in (None, 200)
        return self.alive and self.status == 200 and idle and self.chat_status == 200 and image_ok


@dataclass(slots=True, kw_only=True)
class FamilyRun:
    server: str
    family: str
    generated: int
    selected: int
    sent: int = 0  # follow-ups included
    statuses: dict[str, int] = field(default_factory=dict)
    documented_failures: int = 0
    problems: list[Answer] = field(default_factory=list)
    surprises: list[Answer] = field(default_factory=list)
    faults_counted: int = 0  # growth of courier_request_faults_total
    unattributed_log_errors: list[str] = field(default_factory=list)  # no request's trace: each is a problem
    seconds: float = 0.0
    health_after: Health | None = None

    def count(self, kind: str) -> int:
        return sum(1 for answer in self.problems if answer.outcome == kind or (kind == "5xx" and is_5xx(answer)))


def is_5xx(answer: Answer) -> bool:
    return answer.status is not None and answer.status >= 500


class Hung(Exception):
    """The answer did not arrive whole within the request timeout."""


class Prober:
    """Sends hostile cases to one server and judges each answer; keeps the ids of the records cases refer to."""

    def __init__(self, server: Server, model: str, timeout: float, *, vision: bool, api_key: str = "") -> None:
        self.server = server
        self.model = model
        self.timeout = timeout
        self.vision = vision
        self.api_key = api_key  # the runner's own key on a server with keys: its fixtures and health checks
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self.http = httpx.Client(base_url=server.base_url, timeout=timeout, headers=headers)
        self.anonymous = httpx.Client(base_url=server.base_url, timeout=timeout)
        self.fixtures: dict[str, str] = {}

    def close(self) -> None:
        self.http.close()
        self.anonymous.close()

    def run_families(self, server_name: str, args: argparse.Namespace) -> list[FamilyRun]:
        self.prepare_fixtures()
        runs = []
        families = all_families(self.model, args.seed, vision=self.vision, keyed=bool(self.api_key))
        for family, generate in families.items():
            if args.families is not None and family not in args.families:
                continue
            generated = generate()
            chosen = hostile.select(generated, args.hostile_cases, hostile.family_rng(args.seed, family))
            run = FamilyRun(server=server_name, family=family, generated=len(generated), selected=len(chosen))
            runs.append(run)
            self.run_family(run, chosen)
            progress(family_line(run))
            if not run.health_after or not run.health_after.alive:
                break  # a dead server answers nothing more
        return runs

    def prepare_fixtures(self) -> None:
        """A stored conversation (with an item) and a stored response, for the cases whose paths name one."""
        conversation = self.http.post("/v1/conversations", json={"items": [hostile.user("Hello.")]}).json()
        items = self.http.get(f"/v1/conversations/{conversation['id']}/items").json()
        response = self.http.post("/v1/responses", json=hostile.responses_body(self.model, "Hello.")).json()
        self.fixtures = {"conversation": conversation["id"], "item": items["data"][0]["id"], "response": response["id"]}

    def run_family(self, run: FamilyRun, cases: Sequence[Case]) -> None:
        started = time.monotonic()
        faults_before = self.faults()
        log_start = len(self.server.lines)
        answers: list[Answer] = []
        for case in cases:
            answers += self.send(case)
            if self.server.poll() is not None:
                break
        run.faults_counted = self.faults() - faults_before
        if self.api_key:  # what other keys reached for is still the owner's, whole
            answers += self.read_fixtures_back()
        run.health_after = self.health()  # which also gives the last answers' log lines time to arrive
        run.unattributed_log_errors = attribute_log(answers, self.server.lines[log_start:])
        for answer in answers:
            record(run, answer)
        run.seconds = round(time.monotonic() - started, 1)

    def send(self, case: Case) -> list[Answer]:
        """The case's answer, then those of its follow-ups (when it was accepted)."""
        body = self.resolve_body(case)
        sent = self.resolve(case.path), body
        answer, body = self.exchange(
            case.name,
            case.method,
            *sent,
            expect=case.expect,
            content_type=case.content_type,
            credentials=case.credentials,
        )
        answers = [answer]
        if case.follow_up is FollowUp.ORDINARY:  # whatever the answer: nothing it left behind may fail them
            return [answer, *self.ordinary(case)]
        if case.follow_up is not None and answer.status is not None and 200 <= answer.status < 300:
            record_id = json_id(body)
            if record_id is not None:
                answers += self.follow_up(case, case.follow_up, record_id)
        return answers

    def read_fixtures_back(self) -> list[Answer]:
        paths = ("/v1/responses/{response}", "/v1/conversations/{conversation}/items/{item}")
        reads = (
            self.exchange(f"the owner reads back {p}", "GET", self.resolve(p), None, expect=Expect.OK) for p in paths
        )
        return [answer.must_succeed() for answer, _ in reads]  # another key's case may not remove or hide the record

    def resolve_body(self, case: Case) -> bytes | None:
        """A tenants case's body names the owner's records too; other bodies are sent byte for byte."""
        if case.body is None or case.family != "tenants":
            return case.body
        return self.resolve(case.body.decode()).encode()

    def resolve(self, path: str) -> str:
        for name, value in self.fixtures.items():
            path = path.replace("{" + name + "}", value)
        return path

    def ordinary(self, case: Case) -> list[Answer]:
        """Another client's everyday chat requests after `case`: default sampling and an unseeded draw."""
        answers = []
        for name, extra in (("default sampling", {}), ("temperature 1", {"temperature": 1.0})):
            body = hostile.encode({"model": self.model, "messages": [hostile.user("Hello.")], "max_tokens": 3, **extra})
            answer, _ = self.exchange(f"{case.name} -> {name}", "POST", "/v1/chat/completions", body, expect=Expect.OK)
            answers.append(answer.must_succeed())
        return answers

    def follow_up(self, case: Case, kind: FollowUp, record_id: str) -> list[Answer]:
        turn: dict[str, Any] = {"model": self.model, "input": "And?", "max_output_tokens": 2, "temperature": 0}
        if kind is FollowUp.CHAIN:
            turn["previous_response_id"] = record_id
            read_back = f"/v1/responses/{record_id}"
        else:
            turn["conversation"] = record_id
            read_back = f"/v1/conversations/{record_id}/items?limit=100"
        body = hostile.encode(turn)
        next_turn, _ = self.exchange(f"{case.name} -> next turn", "POST", "/v1/responses", body, expect=Expect.EITHER)
        read, _ = self.exchange(f"{case.name} -> read back", "GET", read_back, None, expect=Expect.OK)
        return [next_turn, read]

    def exchange(
        self,
        name: str,
        method: str,
        path: str,
        body: bytes | None,
        *,
        expect: Expect,
        content_type: str = "application/json",
        credentials: str | None = None,
    ) -> tuple[Answer, bytes]:
        """Send one request (with `credentials`: None the runner's key, "" none, else that key), read the whole answer
        within the timeout, and judge it."""
        request = shorten((body or b"").decode("utf-8", "replace"), SHOWN_CHARS)
        answer = Answer(
            case=name,
            method=method,
            path=shorten(path, 200),
            request=request,
            request_bytes=len(body or b""),
            expect=str(expect),
            trace=uuid.uuid4().hex,
        )
        log_start = len(self.server.lines)
        started = time.monotonic()
        content = b""
        try:
            content, content_kind = self.read_answer(answer, method, path, body, content_type, credentials=credentials)
            judge(answer, content, content_kind, expect)
        except Hung:
            answer.problem = f"timeout: no whole answer within {self.timeout:g} s"
        except httpx.TimeoutException as error:
            answer.problem = f"timeout: {type(error).__name__}"
        except httpx.HTTPError as error:
            answer.problem = f"connection error: {type(error).__name__}: {error}"
        answer.seconds = round(time.monotonic() - started, 3)
        self.attach_log(answer, log_start)
        return answer, content

    def read_answer(
        self, answer: Answer, method: str, path: str, body: bytes | None, content_type: str, *, credentials: str | None
    ) -> tuple[bytes, str]:
        deadline = time.monotonic() + self.timeout
        headers = {"traceparent": f"00-{answer.trace}-{uuid.uuid4().hex[:16]}-01"}
        if body is not None:
            headers["Content-Type"] = content_type
        client = self.anonymous if credentials == "" else self.http
        if credentials:
            headers["Authorization"] = f"Bearer {credentials}"
        with client.stream(method, path, content=body, headers=headers) as response:
            answer.status = response.status_code
            chunks = []
            for chunk in response.iter_bytes():
                chunks.append(chunk)
                if time.monotonic() > deadline:
                    raise Hung
            return b"".join(chunks), response.headers.get("content-type", "")

    def attach_log(self, answer: Answer, start: int) -> None:
        """A failed request keeps the server's log lines written while it ran (its errors come later, by trace)."""
        if answer.problem is not None:
            answer.log = [line.rstrip() for line in self.server.lines[start:]][-60:]
        if self.server.poll() is not None:
            answer.problem = f"the server exited with code {self.server.poll()}: " + (answer.problem or "")

    def faults(self) -> int:
        """courier_request_faults_total, all actors: unexpected exceptions, each failing one request."""
        try:
            text = self.http.get("/metrics").text
        except httpx.HTTPError:
            return 0
        values = re.findall(r"^courier_request_faults_total\{[^}]*\} (\S+)$", text, re.MULTILINE)
        return int(sum(float(value) for value in values))

    def health(self) -> Health:
        """Alive, /health 200 with nothing running or waiting (given time to settle), and a plain chat served."""
        if self.server.poll() is not None:
            return Health(alive=False, detail=f"exited with code {self.server.poll()}")
        try:
            status, scheduler = self.settled_health()
            chat = self.http.post("/v1/chat/completions", json=hostile.chat_body(self.model, [hostile.user("Hi.")]))
            image_status = self.image_chat() if self.vision else None
        except httpx.HTTPError as error:
            return Health(alive=self.server.poll() is None, detail=f"{type(error).__name__}: {error}")
        detail = "" if chat.status_code == 200 else shorten(chat.text, SHOWN_CHARS)
        idle: dict[str, Any] = {key: scheduler.get(key) for key in ("running", "waiting")}
        health = Health(alive=self.server.poll() is None, status=status, detail=detail, **idle)
        health.chat_status, health.image_chat_status = chat.status_code, image_status
        return health

    def settled_health(self) -> tuple[int, dict[str, Any]]:
        deadline = time.monotonic() + SETTLE_S
        while True:
            reply = self.http.get("/health")
            scheduler = reply.json().get("scheduler", {}) if reply.status_code in (200, 503) else {}
            idle = scheduler.get("running") == 0 and scheduler.get("waiting") == 0
            if idle or time.monotonic() > deadline:
                return reply.status_code, scheduler
            time.sleep(0.5)

    def image_chat(self) -> int:
        image = hostile.data_url(hostile.saved_image("PNG", (8, 8)), "image/png")
        content = [{"type": "text", "text": "Look:"}, {"type": "image_url", "image_url": {"url": image}}]
        body = hostile.chat_body(self.model, [hostile.user(content)])
        return self.http.post("/v1/chat/completions", json=body).status_code


def log_records(lines: Sequence[str]) -> list[list[str]]:
    """The log as records: a timestamped line and the lines under it (a traceback)."""
    records: list[list[str]] = []
    for line in lines:
        if LOG_HEAD.match(line) or not records:
            records.append([line.rstrip()])
        else:
            records[-1].append(line.rstrip())
    return records


def is_error(record: Sequence[str]) -> bool:
    head = LOG_HEAD.match(record[0])
    level_error = head is not None and head.group(1) in ("ERROR", "CRITICAL")
    return level_error or any(line.startswith("Traceback (most recent call last)") for line in record)


def attribute_log(answers: Sequence[Answer], lines: Sequence[str]) -> list[str]:
    """Give each error record in `lines` to the answer whose trace it names (a problem, if it had none); return
    the records that name no answer's trace."""
    by_trace = {answer.trace: answer for answer in answers}
    unattributed: list[str] = []
    for log_record in filter(is_error, log_records(lines)):
        match = TRACE.search(log_record[0])
        answer = by_trace.get(match.group(1)) if match else None
        if answer is None:
            unattributed += log_record[:40]
            continue
        answer.log = [*log_record[:1], *log_record[1:][-40:]]
        if answer.problem is None:
            answer.problem = f"the server logged an error: {shorten(log_record[0], 300)}"
    return unattributed


def record(run: FamilyRun, answer: Answer) -> None:
    run.sent += 1
    run.statuses[answer.outcome] = run.statuses.get(answer.outcome, 0) + 1
    if answer.problem is not None:
        run.problems.append(answer)
    elif answer.surprise is not None:
        run.surprises.append(answer)
    if answer.status is not None and (answer.status, answer.code) in DOCUMENTED_FAILURES:
        run.documented_failures += 1


def judge(answer: Answer, content: bytes, content_type: str, expect: Expect) -> None:
    """Set the answer's problem (a failed check) or surprise (sound, but not what the generator expected)."""
    status = answer.status
    assert status is not None
    answer.response = shorten(content.decode("utf-8", "replace"), SHOWN_CHARS)
    answer.code = error_code(content)
    if status >= 500:
        answer.problem = f"{status} {answer.code or ''}".strip()
    elif not 200 <= status < 500:
        answer.problem = f"status {status} is neither 2xx nor 4xx"
    elif status >= 400 and not is_envelope(content):
        answer.problem = f"{status} without OpenAI's error envelope"
    elif status < 300:
        answer.problem = success_problem(content, content_type)
    if answer.problem is None and (status, answer.code) not in DOCUMENTED_FAILURES:
        answer.surprise = surprise(status, expect)


def surprise(status: int, expect: Expect) -> str | None:
    if expect is Expect.REFUSED and status < 300:
        return f"{status} for input the generator expected to be refused"
    if expect is Expect.OK and status >= 400:
        return f"{status} for input the generator expected to be accepted"
    return None


def is_envelope(content: bytes) -> bool:
    try:
        error = json.loads(content)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    keys_ok = isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}
    return keys_ok and isinstance(error["message"], str) and bool(error["message"]) and isinstance(error["type"], str)


def error_code(content: bytes) -> str | None:
    try:
        error = json.loads(content).get("error")
    except (ValueError, AttributeError):
        return None
    code = error.get("code") if isinstance(error, dict) else None
    return str(code) if code is not None else None


def success_problem(content: bytes, content_type: str) -> str | None:
    """A 2xx can still carry a failure: an error event in a stream, or a stored response that failed."""
    if content_type.startswith("text/event-stream"):
        for event in sse_events(content):
            failed = isinstance(event, dict) and (
                ("error" in event and event["error"] is not None) or event.get("type") in ("error", "response.failed")
            )
            if failed:
                return f"a 2xx stream carried an error event: {shorten(json.dumps(event), 300)}"
        return None
    try:
        body = json.loads(content)
    except ValueError:
        return None if content_type.startswith("text/") else "a 2xx whose body is not JSON"
    if isinstance(body, dict) and body.get("object") == "response" and body.get("status") == "failed":
        return f"a 2xx response with status failed: {shorten(json.dumps(body.get('error')), 300)}"
    return None


def sse_events(content: bytes) -> Iterator[Any]:
    for line in content.decode("utf-8", "replace").splitlines():
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            try:
                yield json.loads(line[5:])
            except ValueError:
                yield {"error": f"not JSON: {line[:200]}"}


def json_id(content: bytes) -> str | None:
    try:
        body = json.loads(content)
    except ValueError:
        return None
    record_id = body.get("id") if isinstance(body, dict) else None
    return record_id if isinstance(record_id, str) and body.get("store", True) is not False else None


def shorten(text: str, most: int) -> str:
    return text if len(text) <= most else f"{text[:most]}... ({len(text)} characters)"


def family_line(run: FamilyRun) -> str:
    return (
        f"hostile {run.server}/{run.family}: {run.sent} sent in {run.seconds} s, {statuses_text(run.statuses)}; "
        f"problems {len(run.problems)}, surprises {len(run.surprises)}"
    )


def statuses_text(statuses: dict[str, int]) -> str:
    return ", ".join(f"{status} x{count}" for status, count in sorted(statuses.items()))
