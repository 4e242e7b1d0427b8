"""The urls family (image URLs that break a rule or sit on an edge) and the image-bytes family."""

from __future__ import annotations

import base64
import io
import random
import struct
import zlib
from typing import Any

from PIL import Image

from bench.harness.support import crafted_images, png_header
from bench.hostile.cases import (
    CHAT,
    COMPACT,
    CONVERSATIONS,
    INPUT_TOKENS,
    RESPONSES,
    Case,
    Expect,
    FollowUp,
    Place,
    at_place,
    chat_body,
    compact_body,
    data_url,
    post,
    responses_body,
    saved_image,
    shuffled,
    user,
)


def fixed_urls() -> list[tuple[str, str]]:
    """(name, URL): each breaks a rule of `courier/media/urls.py` or of the address policy, or sits on an edge."""
    data = "data:image/png;base64,"
    return [
        ("IPv6 unclosed", "http://[::1/x.png"), ("IPv6 doubly closed", "http://[::1]]/x.png"),
        ("IPv6 three colons", "http://[:::1]/x.png"), ("IPv6 nine groups", "http://[1:2:3:4:5:6:7:8:9]/x.png"),
        ("IPv6 empty", "http://[]/x.png"), ("IPv6 future version", "http://[v1.x]/x.png"),
        ("IPv6 with zone", "http://[fe80::1%25eth0]/x.png"), ("IPv6 unbracketed", "http://::1/x.png"),
        ("IPv6 mapped loopback", "http://[::ffff:127.0.0.1]/x.png"),
        ("IPv6 mapped metadata", "http://[::ffff:169.254.169.254]/latest/meta-data/"),
        ("IPv6 loopback", "http://[::1]/x.png"), ("IPv6 link-local", "http://[fe80::1]/x.png"),
        ("IPv6 unique local", "http://[fc00::1]/x.png"), ("IPv6 unspecified", "http://[::]/x.png"),
        ("IDNA empty punycode", "http://xn--/x.png"), ("IDNA bad punycode", "http://xn--a.example/x.png"),
        ("IDNA zero-width joiner", "http://a\u200db.example/x.png"),
        ("IDNA fullwidth dot", "http://example\uff0ecom/x.png"), ("IDNA snowman", "http://\u2603.example/x.png"),
        ("IDNA right-to-left mix", "http://a\u05d0.example/x.png"),
        ("IDNA parenthesized digit", "http://\u2488.example/x.png"), ("IDNA leading hyphen", "http://-a.example/x.png"),
        ("empty label", "http://a..b/x.png"), ("only dots", "http://.../x.png"),
        ("label of 64", f"http://{'a' * 64}.example/x.png"),
        ("host of 300", "http://" + ".".join(["a" * 50] * 6) + "/x.png"),
        ("URL of 8193", "http://example.com/" + "a" * 8174), ("URL of 100000", "http://example.com/" + "a" * 100_000),
        ("credentials", "http://user:secret@example.com/x.png"), ("user only", "http://user@example.com/x.png"),
        ("empty credentials", "http://@example.com/x.png"), ("two at signs", "http://a@b@example.com/x.png"),
        ("credentials hiding loopback", "https://example.com@127.0.0.1/x.png"), ("tab", "http://exam\tple.com/x.png"),
        ("CRLF header injection", "http://example.com/x.png\r\nHost: evil"), ("DEL", "http://example.com/\x7f.png"),
        ("space", "http://example .com/x.png"), ("line separator", "http://example.com/\u2028.png"),
        ("NUL in host", "http://exa\x00mple.com/x.png"), ("NUL in path", "http://example.com/x\x00.png"),
        ("encoded NUL", "http://example.com/x%00.png"), ("port 0", "http://example.com:0/x.png"),
        ("port 65536", "http://example.com:65536/x.png"), ("port negative", "http://example.com:-1/x.png"),
        ("port huge", "http://example.com:99999999999999999999/x.png"),
        ("port not a number", "http://example.com:http/x.png"), ("loopback", "http://127.0.0.1/x.png"),
        ("loopback short form", "http://127.1/x.png"), ("loopback hex", "http://0x7f.0.0.1/x.png"),
        ("loopback octal", "http://0177.0.0.1/x.png"), ("loopback decimal", "http://2130706433/x.png"),
        ("localhost", "http://localhost/x.png"), ("localhost with port", "http://localhost:8000/x.png"),
        ("unspecified", "http://0.0.0.0/x.png"), ("private 10/8", "http://10.0.0.1/x.png"),
        ("private 172.16/12", "http://172.16.0.1/x.png"), ("private 192.168/16", "http://192.168.1.1/x.png"),
        ("shared 100.64/10", "http://100.64.0.1/x.png"), ("cloud metadata", "http://169.254.169.254/latest/meta-data/"),
        ("multicast", "http://224.0.0.1/x.png"), ("broadcast", "http://255.255.255.255/x.png"),
        ("reserved .invalid", "https://images.invalid/x.png"), ("uppercase scheme", "HTTP://EXAMPLE.COM/X.PNG"),
        ("file passwd", "file:///etc/passwd"), ("file NUL", "file:///etc/passwd\x00.png"),
        ("file encoded NUL", "file:///etc/passwd%00.png"), ("file traversal", "file:///../../../etc/passwd"),
        ("file encoded traversal", "file:///%2e%2e/%2e%2e/etc/passwd"),
        ("file with host", "file://example.com/etc/passwd"), ("file localhost", "file://localhost/etc/hostname"),
        ("file one slash", "file:/etc/passwd"), ("file bare", "file:"), ("file /dev/zero", "file:///dev/zero"),
        ("file /proc/self/environ", "file:///proc/self/environ"), ("file deep path", "file:///" + "a/" * 5000),
        ("data text/html", "data:text/html;base64,PHNjcmlwdD4="),
        ("data svg", "data:image/svg+xml;base64," + base64.b64encode(b"<svg xmlns='x'/>").decode()),
        ("data not base64", "data:image/png,plain text"), ("data bad base64", data + "@@@@"),
        ("data bad padding", data + "iVBORw0KGgo="), ("data empty", data),
        ("data no comma", "data:image/png;base64"), ("data no media type", "data:;base64,iVBORw0KGgo"),
        ("data uppercase", "DATA:IMAGE/PNG;BASE64,iVBORw0KGgoAAAANSUhEUg=="),
        ("data parameters", 'data:image/png;charset=utf-8;name="x";base64,iVBORw0KGgoAAAANSUhEUg=='),
        ("data whitespace", "data:image/png;base64,iVBO Rw0K\nGgo="), ("data 20 MB", data + "A" * 20_000_000),
        ("data 20 MB, bad last", data + "A" * 19_999_999 + "@"), ("ftp", "ftp://example.com/x.png"),
        ("gopher", "gopher://example.com/x.png"), ("javascript", "javascript:alert(1)"),
        ("jar", "jar:http://example.com/x.jar!/x.png"), ("blob", "blob:http://example.com/0000"),
        ("websocket", "ws://example.com/x.png"), ("scheme-relative", "//example.com/x.png"),
        ("no scheme", "example.com/x.png"), ("scheme only", "http:"), ("no host", "http:///x.png"),
        ("empty host, port", "https://:443/x.png"), ("a space", " "), ("scheme of 17", "abcdefghijklmnopq://x/y.png"),
    ]  # fmt: skip


URL_NOISE = ("\x00", "\t", "\n", " ", "@", ":", "[", "]", "%", "%00", "\\", "#", "?", "/", "..", "\u200b", "é", "xn--")


def mutated_urls(rng: random.Random, count: int) -> list[tuple[str, str]]:
    """Seeded mutations of plain URLs: a few hostile characters inserted at random places."""
    bases = ["http://example.com/a.png", "https://images.example.org:8443/p/q.png?x=1", "file:///srv/a.png"]
    urls = []
    for index in range(count):
        url = rng.choice(bases)
        for _ in range(rng.randrange(1, 4)):
            at = rng.randrange(len(url) + 1)
            url = url[:at] + rng.choice(URL_NOISE) + url[at:]
        urls.append((f"mutation {index}", url))
    return urls


def url_places(model: str) -> list[Place]:
    def image(url: str) -> list[Any]:
        return [user([{"type": "input_text", "text": "Look:"}, {"type": "input_image", "image_url": url}])]

    look, seen = {"type": "text", "text": "Look:"}, [{"role": "assistant", "content": "Seen."}, user("And?")]
    return [
        Place("chat image_url.url", CHAT,
              lambda s: chat_body(model, [user([look, {"type": "image_url", "image_url": {"url": s}}])])),
        Place("responses input_image", RESPONSES, lambda s: responses_body(model, image(s))),
        Place("chat image_url as a string", CHAT,
              lambda s: chat_body(model, [user([{"type": "image_url", "image_url": s}])])),
        Place("responses input_tokens", INPUT_TOKENS, lambda s: {"model": model, "input": image(s)}),
        Place("responses compact", COMPACT, lambda s: compact_body(model, [*image(s), *seen])),
        Place("conversation item", CONVERSATIONS, lambda s: {"items": image(s)}, follow_up=FollowUp.CONVERSATION),
    ]  # fmt: skip


def url_cases(model: str, rng: random.Random, *, vision: bool) -> list[Case]:
    """Every URL in chat and in Responses first, then the other places in a seeded order."""
    places = url_places(model)
    return [
        at_place("urls", name, place, url, url_expectation(place, vision=vision))
        for name, url in [*fixed_urls(), *mutated_urls(rng, 30)]
        for place in shuffled(places, rng, 2)
    ]


def url_expectation(place: Place, *, vision: bool) -> Expect:
    """No URL here can be read: a generation is a 400 (on a text model, `model_not_multimodal` at the latest). A
    count on a text model renders image parts as text and reads nothing, and a conversation stores its items
    unread, so those may be a 2xx."""
    generation = place.path in (CHAT, RESPONSES)
    if generation or (vision and place.path == INPUT_TOKENS):
        return Expect.REFUSED
    return Expect.EITHER


def noisy_jpeg() -> bytes:
    """A JPEG of noise, so that cutting its tail truncates image data rather than padding."""
    buffer = io.BytesIO()
    Image.frombytes("RGB", (64, 48), bytes(range(256)) * 36).save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


def animated_gif(frames: int) -> bytes:
    buffer = io.BytesIO()
    images = [Image.new("P", (2, 2), index % 256) for index in range(frames)]
    images[0].save(buffer, format="GIF", save_all=True, append_images=images[1:])
    return buffer.getvalue()


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_with_huge_text_chunk() -> bytes:
    """A valid 1x1 PNG carrying a 5 MB compressed text chunk (a zTXt bomb) before its pixels."""
    valid = saved_image("PNG")
    bomb = png_chunk(b"zTXt", b"k\x00\x00" + zlib.compress(b"\x00" * 50_000_000, 9))
    return valid[:33] + bomb + valid[33:]


MAGICS = {
    "PNG": b"\x89PNG\r\n\x1a\n",
    "GIF": b"GIF89a",
    "TIFF little-endian": b"II*\x00",
    "TIFF big-endian": b"MM\x00*",
    "BMP": b"BM",
    "DDS": b"DDS |\x00\x00\x00",
    "JPEG": b"\xff\xd8\xff\xe0",
    "WebP": b"RIFF\xff\xff\xff\x7fWEBPVP8 ",
    "ICO": b"\x00\x00\x01\x00",
    "PSD": b"8BPS",
    "PDF": b"%PDF-1.7\n",
}


PNG_HEADERS = (
    ("7000x7000", (7000, 7000)), ("100000x1", (100_000, 1)), ("1x100000", (1, 100_000)),
    ("65535x65535", (65_535, 65_535)), ("0x0", (0, 0)), ("2**31-1 square", (2**31 - 1, 2**31 - 1)),
)  # fmt: skip


def image_payloads(rng: random.Random) -> list[tuple[str, bytes, str, Expect]]:
    """(name, bytes, data: media type, expectation)."""
    png, jpeg, crafted = saved_image("PNG", (40, 30)), noisy_jpeg(), crafted_images()
    svg = b"<svg xmlns='http://www.w3.org/2000/svg' width='9999999' height='9999999'/>"
    payloads: list[tuple[str, bytes, str, Expect]] = [
        ("valid 1x1 PNG", saved_image("PNG"), "image/png", Expect.OK),
        ("valid 1x1 JPEG", saved_image("JPEG"), "image/jpeg", Expect.OK),
        ("valid 1x1 GIF", saved_image("GIF", mode="P"), "image/gif", Expect.OK),
        ("valid 1x1 BMP", saved_image("BMP"), "image/bmp", Expect.OK),
        ("valid 1x1 WebP", saved_image("WEBP"), "image/webp", Expect.OK),
        ("valid 1x1 TIFF (not a format the server reads)", saved_image("TIFF"), "image/tiff", Expect.REFUSED),
        ("valid PNG sent as image/jpeg", png, "image/jpeg", Expect.EITHER),
        ("valid 1x1 grey-alpha PNG", saved_image("PNG", mode="LA"), "image/png", Expect.OK),
        ("valid 1x1 CMYK JPEG", saved_image("JPEG", mode="CMYK"), "image/jpeg", Expect.EITHER),
        ("valid 16-bit PNG", saved_image("PNG", (4, 4), mode="I;16"), "image/png", Expect.EITHER),
        ("real 7000x7000 PNG (49 Mpx)", saved_image("PNG", (7000, 7000), mode="1"), "image/png", Expect.EITHER),
        ("real 100000x1 PNG", saved_image("PNG", (100_000, 1), mode="1"), "image/png", Expect.EITHER),
        ("real 8000x8000 PNG (64 Mpx)", saved_image("PNG", (8000, 8000), mode="1"), "image/png", Expect.REFUSED),
        ("animated GIF, 500 frames", animated_gif(500), "image/gif", Expect.EITHER),
        ("PNG with a zTXt bomb", png_with_huge_text_chunk(), "image/png", Expect.EITHER),
        *((f"PNG header {shown}", png_header(*size), "image/png", Expect.REFUSED) for shown, size in PNG_HEADERS),
        ("PNG signature only", MAGICS["PNG"], "image/png", Expect.REFUSED),
        ("PNG cut after IHDR", png[:33], "image/png", Expect.REFUSED),
        ("PNG without IEND", png[:-12], "image/png", Expect.EITHER),
        ("JPEG SOI only", b"\xff\xd8", "image/jpeg", Expect.REFUSED),
        ("crafted DDS", crafted["dds"], "image/vnd-ms.dds", Expect.REFUSED),
        ("crafted TIFF", crafted["tiff"], "image/tiff", Expect.REFUSED),
        ("SVG", svg, "image/svg+xml", Expect.REFUSED),
        ("one zero byte", b"\x00", "image/png", Expect.REFUSED),
    ]
    for cut in sorted(rng.sample(range(34, len(png) - 12), 3)):
        payloads.append((f"PNG cut at {cut} of {len(png)}", png[:cut], "image/png", Expect.REFUSED))
    for cut in sorted(rng.sample(range(4, len(jpeg) - 2), 3)):
        payloads.append((f"JPEG cut at {cut} of {len(jpeg)}", jpeg[:cut], "image/jpeg", Expect.EITHER))
    for magic_name, magic in MAGICS.items():
        garbage = bytes(rng.randrange(256) for _ in range(rng.randrange(16, 4096)))
        payloads.append((f"{magic_name} magic + garbage", magic + garbage, "image/png", Expect.REFUSED))
    return payloads


def image_cases(model: str, rng: random.Random) -> list[Case]:
    """Each image in chat and in Responses, and a third of them in a count as well; then the image count rule
    on both sides of --max-images (16 by default)."""
    chat_place, responses_place, _, count_place, *_ = url_places(model)
    cases = [
        at_place("image-bytes", name, place, data_url(raw, media_type), expect)
        for name, raw, media_type, expect in image_payloads(rng)
        for place in [chat_place, responses_place, *([count_place] if rng.random() < 1 / 3 else [])]
    ]
    one = {"type": "image_url", "image_url": {"url": data_url(saved_image("PNG"), "image/png")}}
    for count, expect in ((16, Expect.OK), (17, Expect.REFUSED)):
        name = f"chat: {count} valid images"
        body = chat_body(model, [user([{"type": "text", "text": "Look:"}, *[one] * count])])
        cases.append(post("image-bytes", name, name, CHAT, body, expect=expect))
    return cases
