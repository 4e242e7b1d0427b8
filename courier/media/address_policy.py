"""Which media URLs the server may fetch: a pure policy over the URL and the addresses its host resolves to.

Only http and https, no credentials in the URL, and every address the host
resolves to (and the address actually connected to) must be publicly routable.
Refused, by name: "this network"/unspecified, loopback, private, carrier-grade NAT,
link-local (cloud metadata services live there), IETF protocol assignments,
documentation and benchmarking ranges, 6to4 relays, multicast, broadcast and
reserved space; for IPv6 also unique-local, site-local, discard-only, and any
address embedding an IPv4 one (IPv4-mapped, IPv4-compatible, NAT64, 6to4), which
is judged by the IPv4 rules. `allow_private` (COURIER_ALLOW_PRIVATE_MEDIA_URLS=1)
lifts the address rules, not the scheme and credential rules.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_V4_REFUSED: tuple[tuple[str, str], ...] = (
    ("0.0.0.0/8", "unspecified ('this network')"),
    ("10.0.0.0/8", "private"),
    ("100.64.0.0/10", "carrier-grade NAT"),
    ("127.0.0.0/8", "loopback"),
    ("169.254.0.0/16", "link-local (cloud metadata)"),
    ("172.16.0.0/12", "private"),
    ("192.0.0.0/24", "IETF protocol assignments"),
    ("192.0.2.0/24", "documentation"),
    ("192.88.99.0/24", "6to4 relay"),
    ("192.168.0.0/16", "private"),
    ("198.18.0.0/15", "benchmarking"),
    ("198.51.100.0/24", "documentation"),
    ("203.0.113.0/24", "documentation"),
    ("224.0.0.0/4", "multicast"),
    ("255.255.255.255/32", "broadcast"),
    ("240.0.0.0/4", "reserved"),
)
_V6_REFUSED: tuple[tuple[str, str], ...] = (
    ("::/128", "unspecified"),
    ("::1/128", "loopback"),
    ("100::/64", "discard-only"),
    ("2001:db8::/32", "documentation"),
    ("2001::/23", "IETF protocol assignments"),
    ("fc00::/7", "unique-local"),
    ("fe80::/10", "link-local"),
    ("fec0::/10", "site-local"),
    ("ff00::/8", "multicast"),
)
_V4_NETWORKS = tuple((ipaddress.IPv4Network(net), reason) for net, reason in _V4_REFUSED)
_V6_NETWORKS = tuple((ipaddress.IPv6Network(net), reason) for net, reason in _V6_REFUSED)
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_SIXTOFOUR = ipaddress.IPv6Network("2002::/16")
_COMPATIBLE = ipaddress.IPv6Network("::/96")


@dataclass(frozen=True, slots=True, kw_only=True)
class MediaUrl:
    url: str
    scheme: str
    host: str
    port: int


class MediaRefused(ValueError):
    """A URL or address the policy refuses; the message says which rule."""


def parse_media_url(url: str) -> MediaUrl:
    """An http(s) URL with a host and no credentials, or `MediaRefused`."""
    try:
        parts: SplitResult = urlsplit(url)
        port = parts.port
    except ValueError as error:
        raise MediaRefused(f"not a valid URL: {error}") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise MediaRefused(f"only http and https URLs are fetched, not {scheme or 'no scheme'}")
    if parts.username is not None or parts.password is not None:
        raise MediaRefused("URLs with credentials are refused")
    host = parts.hostname
    if not host:
        raise MediaRefused("the URL has no host")
    return MediaUrl(url=url, scheme=scheme, host=host, port=port or (443 if scheme == "https" else 80))


def refusal_reason(address: IPAddress) -> str | None:
    """Why `address` may not be fetched from, or None when it is public."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = _embedded_ipv4(address)
        if embedded is not None:
            reason = refusal_reason(embedded)
            return None if reason is None else f"{reason} (IPv4 {embedded} inside IPv6)"
        for network, reason in _V6_NETWORKS:
            if address in network:
                return reason
    else:
        for v4_network, reason in _V4_NETWORKS:
            if address in v4_network:
                return reason
    if not address.is_global:
        return "not globally routable"
    return None


def check_addresses(host: str, addresses: list[IPAddress], *, allow_private: bool) -> None:
    """Every address the host resolves to must be public: one private answer is enough to refuse."""
    if not addresses:
        raise MediaRefused(f"{host} does not resolve")
    if allow_private:
        return
    for address in addresses:
        reason = refusal_reason(address)
        if reason is not None:
            raise MediaRefused(f"{host} resolves to {address}, a {reason} address")


def _embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address in _NAT64 or (address in _COMPATIBLE and int(address) > 1):
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if address in _SIXTOFOUR:
        return address.sixtofour
    return None
