"""Which kind of engine an upstream is, and how an operator names one: `--upstream` and `--upstream-dns` values.

  loragate   a loragate engine (`loragate engine`): GET /load, X-Loragate-Load, catalog adapters fetched by the
             engine itself from the X-Adapter-Source the gateway sends
  vllm       a vLLM OpenAI server: its load read from its Prometheus /metrics, priorities sent as vLLM's
             `priority`, catalog adapters fetched and loaded by `loragate vllm-agent` beside it
             (vllm_agent/), gateway/vllm.py says what differs

A value is `[KIND=]TARGET[,agent=PORT]`: `http://10.0.0.5:8001` (a loragate engine),
`vllm=http://10.0.0.7:8000,agent=8002` (a vLLM server whose agent listens on port 8002 of the same host), and
for DNS `vllm=vllm-headless:8000,agent=8002`. One grammar for the command line, the Helm chart and the tests.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from urllib.parse import urlsplit


class EngineKind(str, enum.Enum):
    LORAGATE = "loragate"
    VLLM = "vllm"


@dataclass(frozen=True, slots=True)
class EngineTarget:
    """One upstream engine: its base URL (its identity everywhere in the gateway), kind and agent."""

    url: str
    kind: EngineKind = EngineKind.LORAGATE
    agent: str | None = None  # a vLLM engine's `loragate vllm-agent` base URL (same host, its own port)

    @classmethod
    def at(cls, url: str, kind: EngineKind, agent_port: int | None) -> EngineTarget:
        """The engine at `url`, its agent (if any) on `agent_port` of the same host."""
        if agent_port is None:
            return cls(url, kind)
        parts = urlsplit(url)
        host = parts.hostname or ""
        host = f"[{host}]" if ":" in host else host
        return cls(url, kind, f"{parts.scheme}://{host}:{agent_port}")


def split_spec(text: str, flag: str) -> tuple[EngineKind, str, int | None]:
    """`[KIND=]TARGET[,agent=PORT]` -> (kind, TARGET, PORT); ValueError naming `flag` and the problem."""
    kind = EngineKind.LORAGATE
    head, _, options = text.strip().partition(",")
    name, eq, target = head.partition("=")
    if eq and not {":", "/"} & set(name):  # not an "=" inside a URL
        try:
            kind = EngineKind(name.strip().lower())
        except ValueError:
            kinds = ", ".join(k.value for k in EngineKind)
            raise ValueError(f"{flag} {text!r}: unknown engine kind {name!r} (expected {kinds})") from None
    else:
        target = head
    agent_port = None
    for option in (o.strip() for o in options.split(",") if o.strip()):
        key, _, value = option.partition("=")
        if key != "agent":
            raise ValueError(f"{flag} {text!r}: unknown option {key!r} (expected agent=PORT)")
        agent_port = parse_port(value, f"{flag} {text!r}: agent")
    if agent_port is not None and kind is not EngineKind.VLLM:
        raise ValueError(f"{flag} {text!r}: agent=PORT is for vllm engines (vllm=...)")
    return kind, target.strip(), agent_port


def parse_port(text: str, what: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"{what}: expected a port number 1-65535, got {text!r}")
    return int(text)


def parse_upstream(text: str) -> EngineTarget:
    """An `--upstream` value; ValueError saying what is wrong."""
    kind, url, agent_port = split_spec(text, "--upstream")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--upstream {text!r}: expected an http(s):// URL, e.g. http://127.0.0.1:8001")
    return EngineTarget.at(url.rstrip("/"), kind, agent_port)
