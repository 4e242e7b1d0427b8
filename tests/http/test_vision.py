"""A vision model served end to end: images fetched after admission, once, and reaching the model.

A tiny random-weight SmolVLM (tests/support/tiny_vision_model.py) behind a real
server, the official openai client, and a real HTTP server that counts what it is
asked for. Random weights say nothing useful, but they are deterministic: the same
image gives the same tokens and another image other tokens, so an image that did
not reach the model would show.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import openai
import orjson
import pytest
from PIL import Image

from tests.support.media_server import MediaServer, crafted_dds, crafted_tiff, media_server, png_header
from tests.support.server import FIXED_PREFILL_CHUNKS, RunningServer, serving
from tests.support.tiny_vision_model import IMAGE_SEQ_LEN

MODEL = "tiny-vision"
IMAGE_MEMORY = 8 << 20  # --max-image-memory-bytes here: 8 MiB, about two 1000x1000 images
# Each image expands to <fake_token_around_image><global-img> + IMAGE_SEQ_LEN x <image> + <fake_token_around_image>.
TOKENS_PER_IMAGE = IMAGE_SEQ_LEN + 3


@pytest.fixture(scope="module")
def media() -> Iterator[MediaServer]:
    with media_server() as running:
        yield running


@pytest.fixture(scope="module")
def media_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("media")
    (root / "blue.png").write_bytes(png((0, 0, 255)))
    return root


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("trace") / "spans.jsonl"


@pytest.fixture(scope="module")
def server(tiny_vision_dir: Path, cache_dir: Path, media_root: Path, trace_file: Path) -> Iterator[RunningServer]:
    flags = ["--allow-private-media-urls", "--media-path", str(media_root), "--max-images", "3"]
    flags += ["--prompt-cache-min-prefix", "4", "--trace-file", str(trace_file)]
    flags += ["--max-image-memory-bytes", str(IMAGE_MEMORY), *FIXED_PREFILL_CHUNKS]
    with serving(tiny_vision_dir, cache_dir, MODEL, *flags) as running:
        yield running
    an_admitted_request_traces_admission_then_fetch_then_render(trace_file)  # the server stopped: spans flushed


def png(color: tuple[int, int, int], size: tuple[int, int] = (40, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def jpeg() -> bytes:
    """A JPEG whose pixels are noise, so that cutting its tail truncates image data (not just padding)."""
    buffer = io.BytesIO()
    Image.frombytes("RGB", (64, 48), bytes(range(256)) * 36).save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


def data_url(color: tuple[int, int, int]) -> str:
    return "data:image/png;base64," + base64.b64encode(png(color)).decode()


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def ask(client: openai.OpenAI, content: Any, **extra: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=6,
        temperature=0,
        **extra,
    )


def test_health_says_the_model_takes_images(http: httpx.Client) -> None:
    info = http.get("/health").json()["model_info"]
    assert info["accepts_images"] is True
    assert info["architecture"] == "smolvlm"


def test_the_image_reaches_the_model(client: openai.OpenAI) -> None:
    def answer(color: tuple[int, int, int]) -> tuple[str, int]:
        reply = ask(client, [{"type": "text", "text": "What is this?"}, image_part(data_url(color))])
        assert reply.usage is not None
        return str(reply.choices[0].message.content), reply.usage.prompt_tokens

    red, red_tokens = answer((255, 0, 0))
    blue, _ = answer((0, 0, 255))
    again, _ = answer((255, 0, 0))
    assert red == again  # deterministic for one image
    assert red != blue  # so the difference is the pixels
    text_only = ask(client, "What is this?")
    assert text_only.usage is not None
    assert red_tokens - text_only.usage.prompt_tokens == TOKENS_PER_IMAGE


def test_an_image_in_a_tool_result_reaches_the_model(client: openai.OpenAI) -> None:
    """A tool message's image parts (a screenshot tool) stay images in generic tool mode's `<tool_response>`."""

    def answer(*result: Any) -> tuple[str, int]:
        call = {"id": "call_shot", "type": "function", "function": {"name": "screenshot", "arguments": "{}"}}
        messages: Any = [
            {"role": "user", "content": "Take a screenshot."},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_shot", "content": [{"type": "text", "text": "shot:"}, *result]},
        ]
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
        assert reply.usage is not None
        return str(reply.choices[0].message.content), reply.usage.prompt_tokens

    red, red_tokens = answer(image_part(data_url((255, 0, 0))))
    blue, _ = answer(image_part(data_url((0, 0, 255))))
    _, text_tokens = answer()
    assert red != blue  # the pixels reach the model
    assert red_tokens - text_tokens == TOKENS_PER_IMAGE


def test_a_url_is_fetched_once_per_request_after_admission(client: openai.OpenAI, media: MediaServer) -> None:
    before = media.requests["/image.png"]
    url = media.url("/image.png")
    reply = ask(client, [image_part(url), {"type": "text", "text": "and again:"}, image_part(url)])
    assert reply.usage is not None
    assert media.requests["/image.png"] == before + 1
    messages: Any = [{"role": "user", "content": [image_part(url), {"type": "text", "text": "Describe."}]}]
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert media.requests["/image.png"] == before + 2


def test_a_slow_image_host_holds_up_only_its_own_request(client: openai.OpenAI, media: MediaServer) -> None:
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(ask, client, [image_part(media.url("/held")), {"type": "text", "text": "Slow one."}])
        assert media.held.wait(timeout=60)  # its image is being fetched, and the host does not answer yet
        meanwhile = ask(client, "Are you there?")
        assert meanwhile.choices[0].message.content
        assert not held.done()
        media.release.set()
        assert held.result(timeout=120).choices[0].message.content


def test_file_urls_are_confined_to_the_media_path(client: openai.OpenAI, media_root: Path) -> None:
    """A file:// path is joined under --media-path; nothing outside it is read."""
    inside = ask(client, [image_part("file:///blue.png")])
    from_data = ask(client, [image_part(data_url((0, 0, 255)))])
    assert inside.choices[0].message.content == from_data.choices[0].message.content  # the same pixels
    (media_root.parent / "elsewhere.png").write_bytes(png((0, 0, 255)))
    for url in ("file:///../elsewhere.png", "file:///%2e%2e/elsewhere.png", "file:///missing.png"):
        with pytest.raises(openai.BadRequestError) as refused:
            ask(client, [{"type": "text", "text": "Look:"}, image_part(url)])
        assert refused.value.body["param"] == "messages[0].content[1]"  # type: ignore[index]


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("data:image/png;base64," + base64.b64encode(b"not an image at all").decode(), "not a decodable image"),
        ("data:image/jpeg;base64," + base64.b64encode(jpeg()[:-300]).decode(), "not a decodable image"),
        ("/missing", "404"),
    ],
)
def test_a_bad_image_is_a_400_naming_its_part(
    client: openai.OpenAI, http: httpx.Client, media: MediaServer, url: str, reason: str
) -> None:
    url = media.url(url) if url.startswith("/") else url
    with pytest.raises(openai.BadRequestError) as refused:
        ask(client, [{"type": "text", "text": "Look:"}, image_part(url)])
    body: dict[str, Any] = refused.value.body  # type: ignore[assignment]
    assert body["param"] == "messages[0].content[1]"
    assert reason in body["message"]
    assert http.get("/health").json()["scheduler"]["running"] == 0
    assert ask(client, "still serving?").choices[0].message.content


def test_responses_take_input_images_and_count_them(client: openai.OpenAI, media: MediaServer) -> None:
    before = media.requests["/image.png"]
    content: list[Any] = [
        {"type": "input_text", "text": "Describe it."},
        {"type": "input_image", "image_url": media.url("/image.png"), "detail": "auto"},
    ]
    item: Any = {"role": "user", "content": content}
    counted = client.responses.input_tokens.count(model=MODEL, input=[item])
    response = client.responses.create(model=MODEL, input=[item], max_output_tokens=5, temperature=0)
    assert response.usage is not None
    assert response.usage.input_tokens == counted.input_tokens
    text_only = client.responses.input_tokens.count(model=MODEL, input="Describe it.")
    assert counted.input_tokens - text_only.input_tokens == TOKENS_PER_IMAGE
    assert media.requests["/image.png"] == before + 2  # once for the count, once for the response


def test_cached_state_is_reused_for_the_same_image_and_never_for_another(client: openai.OpenAI) -> None:
    question = [{"type": "text", "text": "Tell me a long story about what you see here."}]
    first = ask(client, [*question, image_part(data_url((10, 200, 10)))], user="vision-cache")
    assert first.usage is not None
    assert first.usage.prompt_tokens_details is not None
    repeat = ask(client, [*question, image_part(data_url((10, 200, 10)))], user="vision-cache")
    other = ask(client, [*question, image_part(data_url((200, 10, 10)))], user="vision-cache")
    assert repeat.usage is not None and repeat.usage.prompt_tokens_details is not None
    assert other.usage is not None and other.usage.prompt_tokens_details is not None
    assert repeat.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert repeat.choices[0].message.content == first.choices[0].message.content


def test_a_compaction_reads_each_image_once(http: httpx.Client, media: MediaServer) -> None:
    before = media.requests["/image.png"]
    image = {"type": "input_image", "image_url": media.url("/image.png")}
    history = [
        {"role": "user", "content": [{"type": "input_text", "text": "Look at this."}, image]},
        {"role": "assistant", "content": "A red square."},
        {"role": "user", "content": [{"type": "input_text", "text": "And this one?"}, image]},
        {"role": "assistant", "content": "The same square."},
        {"role": "user", "content": "Thanks."},
    ]
    reply = http.post("/v1/responses/compact", json={"model": MODEL, "input": history, "keep_tokens": 1}, timeout=120)
    # The summary was generated (from the images): ended by its grammar's budget, or cut where there is none (422).
    assert reply.status_code in (200, 422), reply.text
    assert media.requests["/image.png"] == before + 1


def as_data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def redirect_to(location: str) -> Callable[[MediaServer], str]:
    return lambda media: media.url(f"/redirect?to={quote(location, safe='')}")


# Each one, tried as an attacker would, once stopped the whole server. Either refused while the body is validated
# (the URL) or by the media fetcher (the bytes, the redirect, the memory they claim): a 400 naming the part.
HOSTILE: list[tuple[str, str | Callable[[MediaServer], str], str]] = [
    ("malformed-ipv6", "http://[::1/x.png", "not a valid URL"),
    ("empty-label", "http://a..b/x.png", "not a valid name"),
    ("label-over-63", f"http://{'a' * 64}.example/x.png", "not a valid name"),
    ("numeric-host", "http://2130706433/x.png", "not a valid IPv4 address"),
    ("nul-in-file-path", "file:///blue\x00.png", "NUL"),
    ("encoded-nul-in-file-path", "file:///blue%00.png", "NUL"),
    ("data-not-an-image", "data:text/html;base64,PHNjcmlwdD4=", "data:image/<type>;base64"),
    ("data-not-base64", "data:image/png;base64,@@@@", "not valid base64"),
    ("gopher", "gopher://example.com/x.png", "not gopher"),
    ("claims-7000x7000", as_data_url(png_header(7000, 7000)), "over --max-image-memory-bytes"),
    ("header-without-pixels", as_data_url(png_header(500, 500)), "not a decodable image"),
    ("crafted-dds", as_data_url(crafted_dds()), "not a decodable image"),
    ("crafted-tiff", as_data_url(crafted_tiff()), "not a decodable image"),
    ("redirect-to-data", redirect_to(as_data_url(png((1, 2, 3)))), "only http(s) redirects are followed"),
    ("redirect-to-file", redirect_to("file:///blue.png"), "only http(s) redirects are followed"),
]


def still_serving(client: openai.OpenAI, http: httpx.Client) -> None:
    health = http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert health.json()["scheduler"]["running"] == 0
    assert (
        ask(client, [{"type": "text", "text": "And this?"}, image_part(data_url((5, 5, 5)))]).choices[0].message.content
    )


@pytest.mark.parametrize(("url", "reason"), [case[1:] for case in HOSTILE], ids=[case[0] for case in HOSTILE])
def test_a_hostile_image_is_a_400_naming_its_part_and_the_server_goes_on(
    client: openai.OpenAI, http: httpx.Client, media: MediaServer, url: str | Callable[[MediaServer], str], reason: str
) -> None:
    url = url if isinstance(url, str) else url(media)
    with pytest.raises(openai.BadRequestError) as chat:
        ask(client, [{"type": "text", "text": "Look:"}, image_part(url)])
    body: dict[str, Any] = chat.value.body  # type: ignore[assignment]
    assert body["param"] == "messages[0].content[1]"
    assert reason in body["message"], body["message"]
    history: Any = [
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": [{"type": "input_image", "image_url": url}, {"type": "input_text", "text": "?"}]},
    ]
    with pytest.raises(openai.BadRequestError) as responses:
        client.responses.create(model=MODEL, input=history, max_output_tokens=4)
    body = responses.value.body  # type: ignore[assignment]
    assert body["param"] == "input[2].content[0]"
    assert reason in body["message"], body["message"]
    still_serving(client, http)


def test_a_hostile_image_in_a_compaction_is_a_400_naming_its_part(
    client: openai.OpenAI, http: httpx.Client, media: MediaServer
) -> None:
    for url, reason in [
        ("http://a..b/x.png", "not a valid name"),
        (as_data_url(crafted_dds()), "not a decodable image"),
    ]:
        image = {"type": "input_image", "image_url": url}
        history = [
            {"role": "user", "content": [{"type": "input_text", "text": "Look at this."}, image]},
            {"role": "assistant", "content": "Seen."},
            {"role": "user", "content": "Thanks."},
        ]
        reply = http.post("/v1/responses/compact", json={"model": MODEL, "input": history, "keep_tokens": 1})
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == "input[0].content[1]"
        assert reason in reply.json()["error"]["message"]
    still_serving(client, http)


def test_a_request_whose_images_need_more_memory_than_the_budget_names_the_one_that_crosses(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    fits, crosses = as_data_url(png_header(1000, 1000)), as_data_url(png_header(1100, 1000))  # 4.0 MB, 4.4 MB
    with pytest.raises(openai.BadRequestError) as refused:
        ask(client, [image_part(fits), {"type": "text", "text": "and"}, image_part(crosses)])
    body: dict[str, Any] = refused.value.body  # type: ignore[assignment]
    assert body["param"] == "messages[0].content[2]"
    assert f"over --max-image-memory-bytes ({IMAGE_MEMORY})" in body["message"]
    still_serving(client, http)


def test_the_private_address_switch_is_announced(server: RunningServer) -> None:
    assert "--allow-private-media-urls is set" in server.log()


@pytest.fixture(scope="module")
def guarded(tiny_vision_dir: Path, cache_dir: Path) -> Iterator[RunningServer]:
    """The defaults: the address policy on, no media path; and a 1 KiB image limit."""
    with serving(tiny_vision_dir, cache_dir, MODEL, "--max-image-bytes", "1KiB") as running:
        yield running


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("http://127.0.0.1:{port}/image.png", "loopback"),
        ("http://169.254.169.254/latest/meta-data/", "link-local"),
        ("http://user:secret@example.com/image.png", "credentials"),
        ("file:///etc/hostname", "--media-path"),
        ("data:image/png;base64," + base64.b64encode(png((9, 9, 9), (300, 300)) + b"\0" * 2048).decode(), "1024"),
    ],
)
def test_by_default_private_addresses_local_files_and_big_images_are_refused(
    guarded: RunningServer, media: MediaServer, url: str, reason: str
) -> None:
    before = sum(media.requests.values())
    client = guarded.openai_client()
    with pytest.raises(openai.BadRequestError) as refused:
        ask(client, [{"type": "text", "text": "Look:"}, image_part(url.format(port=media.port))])
    body: dict[str, Any] = refused.value.body  # type: ignore[assignment]
    assert body["param"] == "messages[0].content[1]"
    assert reason in body["message"], body["message"]
    assert sum(media.requests.values()) == before
    assert "allow-private-media-urls is set" not in guarded.log()


def test_a_compaction_over_the_image_cap_reads_nothing(http: httpx.Client, media: MediaServer) -> None:
    before = sum(media.requests.values())
    image = {"type": "input_image", "image_url": media.url("/image.png")}
    history: list[Any] = [
        {"role": "user", "content": [{"type": "input_text", "text": "Look."}, image]},
        {"role": "assistant", "content": "Seen."},
        {"role": "user", "content": [{"type": "input_text", "text": "And this."}, image]},
        {"role": "assistant", "content": "Seen."},
        {"role": "user", "content": [image, image]},  # the fourth image is one over --max-images 3
        {"role": "user", "content": "Now what?"},
    ]
    reply = http.post("/v1/responses/compact", json={"model": MODEL, "input": history, "keep_tokens": 1}, timeout=60)
    assert reply.status_code == 400, reply.text
    assert "at most 3" in reply.json()["error"]["message"]
    assert reply.json()["error"]["param"] == "input[4].content[1]"
    assert sum(media.requests.values()) == before


def test_an_automatically_compacted_turn_reads_each_image_once(http: httpx.Client, media: MediaServer) -> None:
    """Its threshold count, the compaction's counts and summary, and the admission share one read per URL."""
    before = media.requests["/image.png"]
    image = {"type": "input_image", "image_url": media.url("/image.png")}
    history = [
        {"role": "user", "content": [{"type": "input_text", "text": "Look at this."}, image]},
        {"role": "assistant", "content": "A red square."},
        {"role": "user", "content": "What colour was it?"},
    ]
    body = {
        "model": MODEL,
        "input": history,
        "max_output_tokens": 4,
        "context_management": [{"type": "compaction", "compact_threshold": 8}],
    }
    reply = http.post("/v1/responses", json=body, timeout=120)
    # Random weights never end a summary: its grammar's budget does (200), or it is cut (422) where there is
    # none; its images were read all the same.
    assert reply.status_code in (200, 422), reply.text
    assert media.requests["/image.png"] == before + 1


def an_admitted_request_traces_admission_then_fetch_then_render(trace_file: Path) -> None:
    """Checked when the module's tests are done and its server stopped (stopping flushes the spans)."""
    spans = [orjson.loads(line) for line in trace_file.read_text().splitlines()]
    children: dict[str, list[dict[str, Any]]] = {}
    for span in spans:
        children.setdefault(span["parent_id"] or "", []).append(span)
    admitted_with_images = 0
    for span in spans:
        if span["name"] != "ingress.AdmitGeneration":
            continue
        steps = sorted(children.get(span["context"]["span_id"], []), key=lambda child: child["start_time"])
        names = [step["name"] for step in steps]
        if "media_fetcher.FetchImages" not in names or "token_counter.TokenizeChat" not in names:
            continue  # no images, or a fetch that failed (nothing is rendered then)
        admitted_with_images += 1
        assert names.index("media_fetcher.FetchImages") < names.index("token_counter.TokenizeChat"), names
    assert admitted_with_images >= 5
