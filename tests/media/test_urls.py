"""Which image URLs are read at all, and how they are normalised: one table each way."""

from __future__ import annotations

import ipaddress

import pytest

from courier.media.address_policy import MediaRefused
from courier.media.urls import MAX_URL_CHARS, DataUri, FileUrl, HttpUrl, http_url, parse_image_url

PNG_BASE64 = "iVBORw0KGgo="


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        # schemes
        ("ftp://example.com/a.png", "not ftp"),
        ("gopher://example.com/", "not gopher"),
        ("javascript:alert(1)", "not javascript"),
        ("//example.com/a.png", "no scheme"),
        ("example.com/a.png", "no scheme"),
        ("", "no scheme"),
        # http(s): what urlsplit, IDNA, the resolver or httpx would raise on
        ("http://[::1/x.png", "not a valid URL"),
        ("http://[::1]x/x.png", "not a valid URL"),
        ("http://[v1.x]/x.png", "not a valid IPv6 address"),
        ("http://[fe80::1%25eth0]/x.png", "zones"),
        ("http://[12345::1]/x.png", "not a valid"),
        ("http://a..b/x.png", "not a valid name"),
        ("http://.example.com/x.png", "not a valid name"),
        (f"http://{'a' * 64}.com/x.png", "not a valid name"),
        (f"http://{'.'.join(['abcdefghi'] * 26)}/x.png", "longer than 253"),
        ("http://exa_mple%41.com/x.png", "not a valid name"),
        ("http://-example.com/x.png", "not a valid name"),
        ("http://xn--zz.com/x.png", "not a valid name"),
        ("http://ex!ample.com/x.png", "not a valid name"),
        # numbers the resolver would read as addresses
        ("http://127.1/x.png", "not a valid IPv4 address"),
        ("http://0x7f.0.0.1/x.png", "not a valid IPv4 address"),
        ("http://2130706433/x.png", "not a valid IPv4 address"),
        ("http://010.0.0.1/x.png", "not a valid IPv4 address"),
        ("http://256.1.1.1/x.png", "not a valid IPv4 address"),
        # the rest of the URL
        ("http://user:secret@example.com/a.png", "credentials"),
        ("https://user@example.com/a.png", "credentials"),
        ("http:///a.png", "no host"),
        ("http://example.com:99999/a.png", "not a valid URL"),
        ("http://example.com:0/a.png", "port 0"),
        ("http://example.com:http/a.png", "not a valid URL"),
        ("http://exa mple.com/a.png", "control character or a space"),
        ("http://example.com/a\x00.png", "control character"),
        ("http://example.com/a\r\nX-Injected: 1", "control character"),
        ("http://example.com/" + "a" * MAX_URL_CHARS, "longer than"),
        # data:
        ("data:image/png;base64", "','"),
        ("data:text/plain;base64,aGVsbG8=", "data:image/<type>;base64"),
        ("data:image/png,rawbytes", "data:image/<type>;base64"),
        ("data:;base64," + PNG_BASE64, "data:image/<type>;base64"),
        ("data:image/png;base64,", "no data"),
        ("data:image/png;base64,@@@@", "not valid base64"),
        ("data:image/png;base64,iVBORw0KGgo", "not valid base64"),
        ("data:image/png;base64,iVBO Rw0KGgo=", "not valid base64"),
        ("data:image/png;base64,iVBORw0KGgo=\n", "not valid base64"),
        # file:
        ("file:///cats/tom\x00.png", "NUL"),
        ("file:///cats/tom%00.png", "NUL"),
        ("file:///cats/\x07.png", "control"),
        ("file://otherhost/cats/tom.png", "no host"),
        ("file:///" + "a" * MAX_URL_CHARS, "longer than"),
    ],
)
def test_refused_urls_say_why(url: str, reason: str) -> None:
    with pytest.raises(MediaRefused, match=reason):
        parse_image_url(url)


@pytest.mark.parametrize(
    ("url", "normalised", "host", "port", "host_header"),
    [
        ("HTTPS://Example.com/cat.png", "https://example.com/cat.png", "example.com", 443, "example.com"),
        ("http://example.com", "http://example.com/", "example.com", 80, "example.com"),
        (
            "http://example.com:8080/a?b=1#frag",
            "http://example.com:8080/a?b=1",
            "example.com",
            8080,
            "example.com:8080",
        ),
        ("http://bücher.example/a.png", "http://xn--bcher-kva.example/a.png", "xn--bcher-kva.example", 80, None),
        ("http://under_score.example/a.png", "http://under_score.example/a.png", "under_score.example", 80, None),
        ("http://93.184.216.34/a.png", "http://93.184.216.34/a.png", "93.184.216.34", 80, None),
        ("http://1.2.3.4./a.png", "http://1.2.3.4/a.png", "1.2.3.4", 80, None),
        ("https://[2606:2800:220:1::]:8443/a", "https://[2606:2800:220:1::]:8443/a", "2606:2800:220:1::", 8443, None),
        ("http://example.com./a.png", "http://example.com./a.png", "example.com.", 80, None),
    ],
)
def test_http_urls_are_normalised(url: str, normalised: str, host: str, port: int, host_header: str | None) -> None:
    parsed = parse_image_url(url)
    assert isinstance(parsed, HttpUrl)
    assert (parsed.url, parsed.host, parsed.port) == (normalised, host, port)
    if host_header is not None:
        assert parsed.host_header == host_header
    assert http_url(parsed.url) == parsed  # normalising is idempotent


def test_address_literals_need_no_resolving() -> None:
    v6 = http_url("https://[2606:2800:220:1::]:8443/a")
    assert v6.address == ipaddress.ip_address("2606:2800:220:1::")
    assert v6.host_header == "[2606:2800:220:1::]:8443"
    assert http_url("http://93.184.216.34/").address == ipaddress.ip_address("93.184.216.34")
    assert http_url("http://example.com/").address is None


def test_data_and_file_urls_parse_without_copying_the_payload() -> None:
    data = parse_image_url(f"DATA:Image/PNG;name=a.png;base64,{PNG_BASE64}")
    assert isinstance(data, DataUri)
    assert data.media_type == "image/png"
    assert data.url[data.payload_start :] == PNG_BASE64
    assert parse_image_url("file:///cats/tom.png") == FileUrl(path="/cats/tom.png")
    assert parse_image_url("file://localhost/cats/a%20b.png") == FileUrl(path="/cats/a%20b.png")
    assert parse_image_url("file:/cats/tom.png") == FileUrl(path="/cats/tom.png")
