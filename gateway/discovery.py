"""Engine replicas found in DNS: `--upstream-dns NAME:PORT`, re-resolved every few seconds.

In Kubernetes NAME is the engines' headless Service: it resolves to one address per ready pod, so an
autoscaler that adds an engine adds an address, and a pod that stops being ready (draining, deleted)
drops out. Each resolution becomes the set of upstream URLs `http://ADDRESS:PORT`; the gateway
(`Gateway.set_upstreams`) adds the new ones and stops sending to the vanished ones, whose requests in
flight finish. Adapter affinity ranks upstreams by rendezvous hashing, so only the adapters a joining
or leaving replica owns move.

A name that does not exist (no ready pod: NXDOMAIN) means no upstream; any other resolver failure (a
timeout, a server error) keeps the last answer, so a DNS hiccup never empties the fleet.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from gateway.engine_kinds import EngineKind, EngineTarget, split_spec

logger = logging.getLogger(__name__)

DNS_INTERVAL_S = 5.0
Resolver = Callable[[str, int], Awaitable[list[str]]]  # (name, port) -> addresses; [] when none exist


async def resolve_addresses(name: str, port: int) -> list[str]:
    """The addresses `name` resolves to (A and AAAA records), [] when the name does not exist."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            return []
        raise
    return sorted({str(info[4][0]) for info in infos})


def parse_target(text: str) -> tuple[str, int]:
    """ "NAME:PORT" -> (NAME, PORT), or ValueError saying what is wrong."""
    name, sep, port = text.rpartition(":")
    if not sep or not name or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--upstream-dns {text!r}: expected [KIND=]NAME:PORT, e.g. loragate-engine-headless:8001")
    return name.strip("[]"), int(port)


def _url(address: str, port: int, scheme: str) -> str:
    host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    return f"{scheme}://{host}:{port}"


@dataclass
class DnsUpstreams:
    """The upstream engines behind one DNS name, all of one kind (gateway/engine_kinds.py)."""

    name: str
    port: int
    resolve: Resolver = resolve_addresses
    scheme: str = "http"
    interval_s: float = DNS_INTERVAL_S
    kind: EngineKind = EngineKind.LORAGATE
    agent_port: int | None = None

    @classmethod
    def from_target(cls, text: str, interval_s: float = DNS_INTERVAL_S) -> DnsUpstreams:
        """An `--upstream-dns` value: `[KIND=]NAME:PORT[,agent=PORT]`."""
        kind, target, agent_port = split_spec(text, "--upstream-dns")
        name, port = parse_target(target)
        return cls(name, port, interval_s=interval_s, kind=kind, agent_port=agent_port)

    def __str__(self) -> str:
        agent = f",agent={self.agent_port}" if self.agent_port is not None else ""
        return f"dns:{self.kind.value}={self.name}:{self.port}{agent}"

    async def targets(self) -> list[EngineTarget] | None:
        """The current engines, or None when the resolver failed (keep what you have)."""
        try:
            addresses = await self.resolve(self.name, self.port)
        except (OSError, ValueError) as exc:
            logger.warning("resolving %s failed (keeping the last upstreams): %s", self.name, exc)
            return None
        return [EngineTarget.at(_url(a, self.port, self.scheme), self.kind, self.agent_port) for a in sorted(addresses)]
