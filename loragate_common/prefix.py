"""A prompt's prefix as chained chunk hashes, one set of rules for the gateway (which engine holds it:
gateway/prefix_index.py) and the engine (which of them its prefix cache still holds: engine/core/memory.py).

The gateway does not tokenize, so it cuts the prompt's canonical text into chunks of `chunk` characters (or of
`chunk` token ids, for a prompt given as ids) and hashes each chunk chained to the ones before it: hash k names
the whole text up to the end of chunk k, under one adapter (the seed holds the adapter id as the gateway sends
it, with its catalog version), just as the engine's prefix cache keys blocks by adapter version and by every
token before them. Only full chunks are hashed: a partial last chunk is never shared with a longer prompt.

Canonical text: a completion's prompt string as given; a chat's tools (JSON) then each message as compact JSON
with sorted keys, one per line. Both are prefix-stable: appending a turn appends text, so turn n+1 of a
conversation shares every full chunk of turn n's messages. A batch of prompts has no single prefix (None).

The gateway sends the chunks to the engine it chose in `X-Loragate-Prefix` (`chunk=256, total=4521,
hashes=<hex>,<hex>,...`); the engine keeps them with the prompt's cached blocks and reports, on GET /load, the
hashes whose text its cache still holds (`PromptChunks.covered` maps tokens to chunks in proportion).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

HEADER = "X-Loragate-Prefix"
HASH_HEX = 16  # 64-bit hashes: a collision costs one routing choice, never a wrong answer
MAX_CHUNKS = 512  # the most hashes a header may carry (the gateway's policy caps it lower)
CHARS_PER_ID = 4  # a chunk of token ids is chunk_chars / this many ids (about as much text)
_HASH_RE = re.compile(f"[0-9a-f]{{{HASH_HEX}}}")


@dataclass(frozen=True, slots=True)
class PromptChunks:
    """A prompt's full chunks as chained hashes (first chunk first)."""

    hashes: tuple[str, ...]
    chunk: int  # units (characters or token ids) per chunk
    total: int  # units in the whole canonical prompt, partial last chunk included

    def header(self) -> str:
        return f"chunk={self.chunk}, total={self.total}, hashes={','.join(self.hashes)}"

    @classmethod
    def parse(cls, header: str) -> PromptChunks | None:
        """The `X-Loragate-Prefix` header, or None where it is malformed (it is only a routing hint)."""
        fields = {}
        for part in header.split(", "):
            name, sep, value = part.partition("=")
            if not sep or name in fields:
                return None
            fields[name] = value
        if fields.keys() != {"chunk", "total", "hashes"}:
            return None
        chunk, total = fields["chunk"], fields["total"]
        if not (chunk.isdigit() and total.isdigit() and len(chunk) <= 9 and len(total) <= 12):
            return None
        hashes = tuple(fields["hashes"].split(",")) if fields["hashes"] else ()
        if len(hashes) > MAX_CHUNKS or not all(_HASH_RE.fullmatch(h) for h in hashes):
            return None
        if int(chunk) < 1 or len(hashes) * int(chunk) > int(total):
            return None
        return cls(hashes, int(chunk), int(total))

    def covered(self, tokens: int, prompt_tokens: int) -> int:
        """How many leading chunks lie within a prompt's first `tokens` of `prompt_tokens` tokens, reading
        text and tokens in proportion (a chat template's few added tokens shift it by a fraction of a chunk)."""
        if prompt_tokens <= 0 or tokens <= 0:
            return 0
        units = min(tokens, prompt_tokens) * self.total // prompt_tokens
        return min(len(self.hashes), units // self.chunk)


def canonical_prompt(body: Mapping[str, Any], chat: bool) -> str | list[int] | None:
    """The text (or token ids) a request's prompt is made of, prefix-stable across turns; None when it has no
    single prompt (a batch) or is malformed, ids out of range included (the engine answers that)."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        head = json.dumps(body["tools"], sort_keys=True, separators=(",", ":")) + "\n" if body.get("tools") else ""
        return head + "".join(json.dumps(m, sort_keys=True, separators=(",", ":")) + "\n" for m in messages)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**63 for t in prompt
    ):
        return prompt
    return None


def prompt_chunks(
    body: Mapping[str, Any], chat: bool, adapter: str | None, chunk_chars: int, max_chunks: int
) -> PromptChunks | None:
    """The chained hashes of the first `max_chunks` full chunks of a request's prompt under `adapter` (None:
    the base model); None when it has no single prompt."""
    prompt = canonical_prompt(body, chat)
    if prompt is None:
        return None
    ids = isinstance(prompt, list)
    chunk = max(1, chunk_chars // CHARS_PER_ID) if ids else chunk_chars
    seed = f"loragate-prefix\0{'ids' if ids else 'text'}\0{chunk}\0{adapter or ''}".encode()
    digest = hashlib.blake2b(seed, digest_size=HASH_HEX // 2).digest()
    hashes = []
    for k in range(min(max_chunks, len(prompt) // chunk)):
        piece = prompt[k * chunk : (k + 1) * chunk]
        data = b"".join(t.to_bytes(8, "little") for t in piece) if ids else piece.encode()  # type: ignore[union-attr]
        digest = hashlib.blake2b(digest + data, digest_size=HASH_HEX // 2).digest()
        hashes.append(digest.hex())
    return PromptChunks(tuple(hashes), chunk, len(prompt))


def session_hash(tenant: str, session: str) -> str:
    """The index key of a tenant's session (its sticky key's value): tenants' sessions never meet."""
    raw = f"loragate-session\0{tenant}\0{session}".encode()
    return "s" + hashlib.blake2b(raw, digest_size=HASH_HEX // 2).hexdigest()
