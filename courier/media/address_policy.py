"""Which addresses the server may fetch media from: a pure policy over the addresses a URL's host resolves to.

Every address the host resolves to must be publicly routable; the fetcher then
connects to one of those very addresses (`fetcher.py`), never resolving again.
Which URLs are read at all is `urls.py`'s business. Refused, by name: "this
network"/unspecified, loopback, private, carrier-grade NAT, link-local (cloud
metadata services live there), IETF protocol assignments, documentation and
benchmarking ranges, 6to4 relays, multicast, broadcast and reserved space; for
IPv6 also unique-local, site-local, discard-only, and any address embedding an
IPv4 one (IPv4-mapped, IPv4-compatible, NAT64, 6to4), which is judged by the
IPv4 rules. `allow_private` (COURIER_ALLOW_PRIVATE_MEDIA_URLS=1)
lifts these rules, not the URL rules.
"""

from __future__ import annotations

import ipaddress

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


class MediaRefused(ValueError):
    """A URL or address the policy refuses; the message says which rule."""


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
