"""Where a remote model may be reached: the addresses its ``base_url`` resolves to, and which of
them this box refuses to forward to.

A remote is an address an admin typed in, reached from inside the box's network, so every
address its host resolves to is checked (a name that resolves to a public and a loopback address
cannot slip through) and the connection then goes to one of exactly those addresses
(``web.pinned_http``): the name is never resolved a second time, so a DNS answer that changes
between the check and the connection (rebinding) cannot send the request elsewhere.

Refused always: cloud metadata services (``169.254.169.254``, AWS's ``fd00:ec2::254``,
Alibaba's ``100.100.100.200``) and multicast. Refused unless ``server.allow_local_remotes``:
loopback, link-local and unspecified addresses (this host and its link). Refused unless
``server.allow_private_remotes``: the private ranges (``10/8``, ``172.16/12``, ``192.168/16``,
``fc00::/7``) and the shared CGNAT range (``100.64/10``).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
#: ``(host, port) -> addresses``: how a remote's host name is resolved (a test may answer for
#: it; everything else uses the system's resolver).
Resolver = Callable[[str, int], list[str]]

METADATA = frozenset(
    ipaddress.ip_address(a) for a in ("169.254.169.254", "fd00:ec2::254", "100.100.100.200")
)
PRIVATE = tuple(
    ipaddress.ip_network(n)
    for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "fc00::/7")
)


def system_resolver(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


@dataclass(frozen=True)
class Allowed:
    """Which refusable classes of address the configuration lets through."""

    local: bool = False  # server.allow_local_remotes
    private: bool = False  # server.allow_private_remotes


#: NAT64 prefixes (RFC 6052's well-known one, RFC 8215's local-use one): the IPv4 address is
#: the last 32 bits.
_NAT64 = (ipaddress.IPv6Network("64:ff9b::/96"), ipaddress.IPv6Network("64:ff9b:1::/48"))


def _nat64(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if any(ip in net for net in _NAT64):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def refusal(ip: IPAddress, allowed: Allowed = Allowed()) -> tuple[str, str | None] | None:
    """Why ``ip`` is not a remote this box forwards to — (the reason, the setting that would
    allow it, or None when nothing does) — or None when it is one."""
    if isinstance(ip, ipaddress.IPv6Address):
        # ::ffff:127.0.0.1 is 127.0.0.1, and so is 6to4's 2002:7f00:1::, and NAT64's
        # 64:ff9b::7f00:1 (a DNS64 network resolves names to it).
        inner = ip.ipv4_mapped or ip.sixtofour or _nat64(ip)
        if inner is not None:
            return refusal(inner, allowed)
    if ip in METADATA:
        return "a cloud metadata service", None
    if ip.is_multicast:
        return "a multicast address", None
    if not allowed.local:
        for reason, hit in (
            ("an unspecified address", ip.is_unspecified),
            ("a loopback address", ip.is_loopback),
            ("a link-local address", ip.is_link_local),
        ):
            if hit:
                return reason, "server.allow_local_remotes"
    if not allowed.private and any(ip.version == n.version and ip in n for n in PRIVATE):
        return "in a private range", "server.allow_private_remotes"
    return None


def parse(address: str) -> IPAddress:
    return ipaddress.ip_address(address.split("%", 1)[0])  # fe80::1%eth0: the scope goes


def first_refused(
    addresses: Iterable[str], allowed: Allowed = Allowed()
) -> tuple[str, str, str | None] | None:
    """The first of ``addresses`` that is refused, with why (see ``refusal``), or None."""
    for a in addresses:
        why = refusal(parse(a), allowed)
        if why is not None:
            return a, *why
    return None
