"""The media address policy: every refused range, v4 and v6 (the URL rules are in test_urls.py)."""

from __future__ import annotations

import ipaddress

import pytest

from courier.media.address_policy import MediaRefused, check_addresses, refusal_reason

REFUSED = [
    ("0.0.0.0", "unspecified"),
    ("0.1.2.3", "unspecified"),
    ("10.1.2.3", "private"),
    ("100.64.0.1", "carrier-grade NAT"),
    ("100.127.255.254", "carrier-grade NAT"),
    ("127.0.0.1", "loopback"),
    ("127.255.0.9", "loopback"),
    ("169.254.169.254", "link-local"),
    ("172.16.0.1", "private"),
    ("172.31.255.255", "private"),
    ("192.0.0.8", "IETF protocol assignments"),
    ("192.0.2.10", "documentation"),
    ("192.88.99.1", "6to4 relay"),
    ("192.168.1.1", "private"),
    ("198.18.0.1", "benchmarking"),
    ("198.19.255.1", "benchmarking"),
    ("198.51.100.7", "documentation"),
    ("203.0.113.9", "documentation"),
    ("224.0.0.1", "multicast"),
    ("239.255.255.250", "multicast"),
    ("240.0.0.1", "reserved"),
    ("255.255.255.255", "broadcast"),
    ("::", "unspecified"),
    ("::1", "loopback"),
    ("fc00::1", "unique-local"),
    ("fd12:3456::1", "unique-local"),
    ("fe80::1", "link-local"),
    ("fec0::1", "site-local"),
    ("ff02::1", "multicast"),
    ("2001:db8::1", "documentation"),
    ("2001:2::1", "IETF protocol assignments"),  # the IPv6 benchmarking range sits inside it
    ("100::1", "discard-only"),
    ("::ffff:127.0.0.1", "loopback (IPv4 127.0.0.1 inside IPv6)"),
    ("::ffff:169.254.169.254", "link-local (cloud metadata) (IPv4 169.254.169.254 inside IPv6)"),
    ("::ffff:10.0.0.1", "private (IPv4 10.0.0.1 inside IPv6)"),
    ("::127.0.0.1", "loopback (IPv4 127.0.0.1 inside IPv6)"),
    ("::10.0.0.1", "private (IPv4 10.0.0.1 inside IPv6)"),
    ("64:ff9b::a9fe:a9fe", "link-local (cloud metadata) (IPv4 169.254.169.254 inside IPv6)"),
    ("2002:c0a8:0101::1", "private (IPv4 192.168.1.1 inside IPv6)"),
]
ALLOWED = ["8.8.8.8", "1.1.1.1", "93.184.216.34", "2606:4700:4700::1111", "2a00:1450:4001::200e", "::ffff:8.8.8.8"]


@pytest.mark.parametrize(("address", "reason"), REFUSED)
def test_refused_ranges(address: str, reason: str) -> None:
    assert refusal_reason(ipaddress.ip_address(address)) is not None
    assert reason in (refusal_reason(ipaddress.ip_address(address)) or "")


@pytest.mark.parametrize("address", ALLOWED)
def test_public_addresses_are_allowed(address: str) -> None:
    assert refusal_reason(ipaddress.ip_address(address)) is None


def test_one_private_answer_among_public_ones_refuses_the_host() -> None:
    public, private = ipaddress.ip_address("8.8.8.8"), ipaddress.ip_address("10.0.0.1")
    check_addresses("media.test", [public], allow_private=False)
    with pytest.raises(MediaRefused, match=r"10\.0\.0\.1"):
        check_addresses("media.test", [public, private], allow_private=False)
    check_addresses("media.test", [public, private], allow_private=True)
    with pytest.raises(MediaRefused, match="does not resolve"):
        check_addresses("media.test", [], allow_private=True)
