"""Which image URLs the server will read at all: a pure parser, used where a request enters and again by the fetcher.

A request's image URLs are checked while its body is validated (a 400 naming the
part, before any actor sees them) and parsed again by the fetcher, which reads
only what this module returns, so nothing the fetcher, the resolver or httpx
would choke on (a malformed IPv6 literal, a host IDNA refuses, a NUL byte in a
path) reaches them. Accepted:

- `http(s)://host[:port]/path?query`: no credentials, no control characters or
  spaces, at most `MAX_URL_CHARS`; the host an IDNA-encodable name (each label 1
  to 63 characters, 253 in all), a canonical dotted-quad IPv4 address (no
  `127.1`, `0x7f.0.0.1` or `2130706433`: the resolver would read those as
  addresses) or a well-formed bracketed IPv6 literal without a zone. Normalised
  to a lowercase ASCII host and no fragment.
- `data:image/<subtype>[;param=value]*;base64,<payload>`: an image media type and
  a strictly base64 payload.
- `file://[localhost]/path`: no NUL (raw or `%00`) or control characters; where
  the path may lead is `local_sources`' business.

Whether the host's addresses may be fetched from is `address_policy`'s.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import TypeAlias
from urllib.parse import unquote, urlsplit

from courier.media.address_policy import IPAddress, MediaRefused

MAX_URL_CHARS = 8192  # http(s) and file URLs; a data: URI is bounded by --max-image-bytes instead
MAX_HOST_CHARS = 253
MAX_LABEL_CHARS = 63
DEFAULT_PORTS = {"http": 80, "https": 443}
SCHEMES = ("http", "https", "data", "file")

_CONTROL_OR_SPACE = re.compile(r"[\x00-\x20\x7f]")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_SCHEME = re.compile(r"[a-z][a-z0-9+.-]{0,15}")
_LABEL = re.compile(r"[a-z0-9_](?:[a-z0-9_-]*[a-z0-9_])?")
_NUMERIC_LABEL = re.compile(r"(?:0x[0-9a-f]*|[0-9]+)")
_DATA_HEADER = re.compile(
    r"image/[a-z0-9][a-z0-9!#$&^_.+-]{0,126}(?:;[a-z0-9!#$&^_.+-]+=[^;,]*)*;base64", re.IGNORECASE
)
_BASE64 = re.compile(r"(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?")


@dataclass(frozen=True, slots=True, kw_only=True)
class HttpUrl:
    url: str  # normalised: what the fetcher asks for
    scheme: str
    host: str  # lowercase ASCII (an IDNA name) or an address, IPv6 without brackets
    port: int
    address: IPAddress | None  # the host, when it is an address literal (nothing to resolve)
    explicit_port: bool = False

    @property
    def host_header(self) -> str:
        """The Host header (and the name TLS is checked against) for a request that connects to a pinned address."""
        host = f"[{self.host}]" if isinstance(self.address, ipaddress.IPv6Address) else self.host
        return f"{host}:{self.port}" if self.explicit_port else host


@dataclass(frozen=True, slots=True, kw_only=True)
class DataUri:
    url: str
    media_type: str
    payload_start: int  # where the base64 payload begins in `url` (not copied: it may be megabytes)


@dataclass(frozen=True, slots=True, kw_only=True)
class FileUrl:
    path: str  # as written, still percent-encoded; always starts with "/"


ImageUrl: TypeAlias = HttpUrl | DataUri | FileUrl


def parse_image_url(url: str) -> ImageUrl:
    """The image URL parsed and normalised, or `MediaRefused` saying which rule it breaks."""
    scheme, colon, _ = url.partition(":")
    scheme = scheme.lower()
    if not colon or not _SCHEME.fullmatch(scheme):
        raise MediaRefused("the URL has no scheme: http, https, data or file")
    if scheme not in SCHEMES:
        raise MediaRefused(f"only http, https, data and file URLs are read, not {scheme}")
    if scheme == "data":
        return data_uri(url)
    if scheme == "file":
        return file_url(url)
    return http_url(url)


def http_url(url: str) -> HttpUrl:
    """An http(s) URL with a valid host and no credentials, normalised, or `MediaRefused`."""
    if len(url) > MAX_URL_CHARS:
        raise MediaRefused(f"the URL is longer than {MAX_URL_CHARS} characters")
    if _CONTROL_OR_SPACE.search(url):
        raise MediaRefused("the URL holds a control character or a space")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as error:
        raise MediaRefused(f"not a valid URL: {error}") from None
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        raise MediaRefused(f"only http and https URLs are fetched, not {scheme or 'no scheme'}")
    if "@" in parts.netloc:
        raise MediaRefused("URLs with credentials are refused")
    if port == 0:
        raise MediaRefused("port 0 is not a port")
    host, address = _host(parts.netloc, parts.hostname or "")
    netloc = f"[{host}]" if isinstance(address, ipaddress.IPv6Address) else host
    if port is not None:
        netloc += f":{port}"
    query = f"?{parts.query}" if parts.query else ""
    return HttpUrl(
        url=f"{scheme}://{netloc}{parts.path or '/'}{query}",
        scheme=scheme,
        host=host,
        port=port or DEFAULT_PORTS[scheme],
        address=address,
        explicit_port=port is not None,
    )


def data_uri(url: str) -> DataUri:
    """`data:image/<subtype>[;params];base64,<payload>` with a valid base64 payload, or `MediaRefused`."""
    comma = url.find(",")
    if comma < 0:
        raise MediaRefused("a data: URI needs a ',' before its data")
    header = url[len("data:") : comma]
    if not _DATA_HEADER.fullmatch(header):
        raise MediaRefused(
            f"a data: URI must be data:image/<type>;base64,<data> (a base64 image), not 'data:{header[:64]}'"
        )
    start = comma + 1
    if start == len(url):
        raise MediaRefused("the data: URI holds no data")
    if not _BASE64.fullmatch(url, start):
        raise MediaRefused("the data: URI's payload is not valid base64")
    return DataUri(url=url, media_type=header.split(";", 1)[0].lower(), payload_start=start)


def file_url(url: str) -> FileUrl:
    """A `file:` URL naming no host and holding no NUL or control character, or `MediaRefused`."""
    if len(url) > MAX_URL_CHARS:
        raise MediaRefused(f"the URL is longer than {MAX_URL_CHARS} characters")
    if _CONTROL.search(url) or "\x00" in unquote(url):
        raise MediaRefused("NUL and control characters are refused in file:// URLs")
    try:
        parts = urlsplit(url)
    except ValueError as error:
        raise MediaRefused(f"not a valid URL: {error}") from None
    if parts.netloc not in ("", "localhost"):
        raise MediaRefused("file:// URLs name no host (file:///path)")
    return FileUrl(path="/" + parts.path.lstrip("/"))


def _host(netloc: str, hostname: str) -> tuple[str, IPAddress | None]:
    """The host, lowercase ASCII, and the address it is when it is a literal one."""
    if not hostname:
        raise MediaRefused("the URL has no host")
    if netloc.startswith("["):
        if "%" in hostname:
            raise MediaRefused("IPv6 zones are refused in URLs")
        if netloc.partition("]")[2][:1] not in ("", ":"):
            raise MediaRefused("not a valid URL: only a port may follow an IPv6 address")
        try:
            return hostname, ipaddress.IPv6Address(hostname)
        except ValueError:
            raise MediaRefused(f"[{hostname[:64]}] is not a valid IPv6 address") from None
    labels = hostname.rstrip(".").split(".")
    if _NUMERIC_LABEL.fullmatch(labels[-1].lower()):
        try:
            return hostname.rstrip("."), ipaddress.IPv4Address(hostname.rstrip("."))
        except ValueError:
            raise MediaRefused(f"{hostname[:64]} is not a valid IPv4 address (a.b.c.d, in decimal)") from None
    return _idna_host(hostname), None


def _idna_host(hostname: str) -> str:
    try:
        encoded = hostname.encode("idna").decode("ascii").lower()
    except UnicodeError:
        raise MediaRefused(
            f"the host {hostname[:64]!r} is not a valid name (each label 1 to {MAX_LABEL_CHARS} characters)"
        ) from None
    if len(encoded.rstrip(".")) > MAX_HOST_CHARS:
        raise MediaRefused(f"the host name is longer than {MAX_HOST_CHARS} characters")
    for label in encoded.rstrip(".").split("."):
        if not _LABEL.fullmatch(label) or not _valid_punycode(label):
            raise MediaRefused(f"the host {hostname[:64]!r} is not a valid name ({label[:64]!r})")
    return encoded


def _valid_punycode(label: str) -> bool:
    if not label.startswith("xn--"):
        return True
    try:
        label.encode("ascii").decode("idna")
    except UnicodeError:
        return False
    return True
