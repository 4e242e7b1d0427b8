"""Image blocks on the Messages API go through the same media admission as chat's image parts: base64 sources as
`data:` URLs, URL sources fetched once after admission, counted as the tokens they expand to, and refused by a
text-only model before anything is read.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from PIL import Image

from tests.support.lazy_modules import lazily
from tests.support.media_server import MediaServer, media_server
from tests.support.server import RunningServer, serving
from tests.support.tiny_vision_model import IMAGE_SEQ_LEN

if TYPE_CHECKING:
    import anthropic
else:
    anthropic = lazily("anthropic")  # tests/support/lazy_modules.py: not at collection

MODEL = "tiny-vision"
TOKENS_PER_IMAGE = IMAGE_SEQ_LEN + 3  # <fake_token_around_image><global-img> + the image tokens + <fake_...>


@pytest.fixture(scope="module")
def media() -> Iterator[MediaServer]:
    with media_server() as running:
        yield running


@pytest.fixture(scope="module")
def vision_server(tiny_vision_dir: Path, cache_dir: Path) -> Iterator[RunningServer]:
    with serving(tiny_vision_dir, cache_dir, MODEL, "--allow-private-media-urls") as running:
        yield running


@pytest.fixture(scope="module")
def claude(vision_server: RunningServer) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=vision_server.base_url, api_key="unused", max_retries=0) as client:
        yield client


def png(color: tuple[int, int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (40, 30), color).save(buffer, format="PNG")
    return buffer.getvalue()


def base64_image(color: tuple[int, int, int]) -> dict[str, Any]:
    data = base64.b64encode(png(color)).decode()
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}


def asking(*blocks: Any) -> list[Any]:
    return [{"role": "user", "content": [*blocks, {"type": "text", "text": "What is this?"}]}]


def test_a_base64_image_is_read_and_counted(claude: anthropic.Anthropic) -> None:
    counted = claude.messages.count_tokens(model=MODEL, messages=asking(base64_image((255, 0, 0)))).input_tokens
    text_only = claude.messages.count_tokens(model=MODEL, messages=asking()).input_tokens
    assert counted - text_only == TOKENS_PER_IMAGE
    message = claude.messages.create(model=MODEL, max_tokens=4, messages=asking(base64_image((255, 0, 0))))
    usage = message.usage
    assert (
        usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0) == counted
    )


def test_a_url_image_is_fetched_once_after_admission(claude: anthropic.Anthropic, media: MediaServer) -> None:
    before = media.requests["/image.png"]
    image = {"type": "image", "source": {"type": "url", "url": media.url("/image.png")}}
    with claude.messages.stream(model=MODEL, max_tokens=4, messages=asking(image, image)) as stream:
        assert stream.get_final_message().stop_reason in ("end_turn", "max_tokens")
    assert media.requests["/image.png"] == before + 1  # twice in the message, read once


def test_a_text_only_model_refuses_an_image_before_reading_it(
    messages_client: anthropic.Anthropic, media: MediaServer
) -> None:
    before = media.requests["/image.png"]
    image = {"type": "image", "source": {"type": "url", "url": media.url("/image.png")}}
    with pytest.raises(anthropic.BadRequestError) as refused:
        messages_client.messages.create(model="claude-opus-4-8", max_tokens=4, messages=asking(image))
    error: Any = refused.value.body
    assert (error["error"]["code"], error["error"]["param"]) == ("model_not_multimodal", "messages[0].content[0]")
    assert media.requests["/image.png"] == before


def screenshot_turn(*result: Any) -> list[Any]:
    """A tool call and its result holding `result`'s blocks, as Claude Code sends a screenshot back."""
    call = {"type": "tool_use", "id": "toolu_shot", "name": "screenshot", "input": {}}
    return [
        {"role": "user", "content": "Take a screenshot."},
        {"role": "assistant", "content": [call]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_shot", "content": list(result)}]},
    ]


def test_an_image_inside_a_tool_result_is_read_and_counted(claude: anthropic.Anthropic, media: MediaServer) -> None:
    caption = {"type": "text", "text": "The screen:"}
    with_image = screenshot_turn(caption, base64_image((0, 0, 255)))
    counted = claude.messages.count_tokens(model=MODEL, messages=with_image).input_tokens
    text_only = claude.messages.count_tokens(model=MODEL, messages=screenshot_turn(caption)).input_tokens
    assert counted - text_only == TOKENS_PER_IMAGE
    message = claude.messages.create(model=MODEL, max_tokens=4, messages=with_image)
    usage = message.usage
    assert (
        usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0) == counted
    )
    before = media.requests["/image.png"]
    by_url = {"type": "image", "source": {"type": "url", "url": media.url("/image.png")}}
    claude.messages.create(model=MODEL, max_tokens=4, messages=screenshot_turn(by_url))
    assert media.requests["/image.png"] == before + 1


def test_a_text_only_model_refuses_a_tool_results_image_naming_it(
    messages_client: anthropic.Anthropic, media: MediaServer
) -> None:
    before = media.requests["/image.png"]
    image = {"type": "image", "source": {"type": "url", "url": media.url("/image.png")}}
    with pytest.raises(anthropic.BadRequestError) as refused:
        messages_client.messages.create(model="claude-opus-4-8", max_tokens=4, messages=screenshot_turn(image))
    error: Any = refused.value.body
    where = "messages[2].content[0].content[0]"
    assert (error["error"]["code"], error["error"]["param"]) == ("model_not_multimodal", where)
    assert media.requests["/image.png"] == before
