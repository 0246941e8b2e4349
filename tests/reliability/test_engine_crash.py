"""`kill -9` of one of two engines while streams run on both: the streams it served end with an error event
(never a token twice), requests that had not started go to the survivor, its breaker opens, and once the
engine is back on its port the breaker closes again."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx

from polling import poll
from stack import MAX_MODEL_LEN, PROMPT, Stack, auth, metric, policy_yaml

LONG = {"prompt": PROMPT, "temperature": 0, "max_tokens": MAX_MODEL_LEN - 16, "ignore_eos": True}


async def _streams(url: str, count: int, started: asyncio.Event) -> list[tuple[str, list[dict]]]:
    """`count` long streams through the gateway; sets `started` once each has its first token. Each
    result: the text received, and every event's JSON."""
    begun = 0

    async def one(http: httpx.AsyncClient) -> tuple[str, list[dict]]:
        nonlocal begun
        text, events = "", []
        async with http.stream(
            "POST", "/v1/completions", json={**LONG, "stream": True}, headers=auth("globex")
        ) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    events.append({"done": True})
                    break
                event = json.loads(data)
                events.append(event)
                if event.get("choices"):
                    if not text:
                        begun += 1
                        if begun == count:
                            started.set()
                    text += event["choices"][0]["text"]
        return text, events

    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        return list(await asyncio.gather(*(one(http) for _ in range(count))))


def test_kill_9_of_an_engine_mid_stream(tmp_path: Path, suite_adapters: Path) -> None:
    stack = Stack(tmp_path, suite_adapters, policy=policy_yaml(open_seconds=2)).start()
    try:
        victim, survivor = stack.engines
        full = httpx.post(f"{survivor.url}/v1/completions", json=LONG, timeout=120).json()["choices"][0]["text"]

        async def scenario() -> list[tuple[str, list[dict]]]:
            started = asyncio.Event()
            task = asyncio.create_task(_streams(stack.url, 6, started))
            await asyncio.wait_for(started.wait(), 60)
            assert metric(victim.url, "loragate_engine_requests_running") > 0  # it holds some streams
            victim.kill()
            return await task

        results = asyncio.run(scenario())
        broken = [r for r in results if any("error" in e for e in r[1])]
        whole = [r for r in results if r not in broken]
        assert broken and whole  # both engines held streams
        for text, events in results:
            assert events[-1] == {"done": True}  # every stream ends properly, cut or not
            assert full.startswith(text)  # no token twice, none out of order
        for text, events in broken:
            assert events[-2]["error"]["type"] == "upstream_error" and len(text) < len(full)
        for text, _ in whole:
            assert text == full

        # Requests that had not started: those sent to the dead engine are retried on the survivor.
        answers = [
            httpx.post(
                f"{stack.url}/v1/completions", json={**LONG, "max_tokens": 4}, headers=auth("globex"), timeout=60
            )
            for _ in range(6)
        ]
        assert [a.status_code for a in answers] == [200] * 6

        def tripped() -> bool:
            # Traffic, so that the state is read while requests meet it: an open breaker turns half_open on its
            # own after open_seconds (2 s here, less than six answers may take on a slow machine), and only a
            # request routed to the dead engine (a failing probe) opens it again.
            httpx.post(
                f"{stack.url}/v1/completions", json={**LONG, "max_tokens": 2}, headers=auth("globex"), timeout=60
            ).raise_for_status()
            return stack.breakers()[victim.url] != "closed"  # open, or half_open: only reached through open

        poll(tripped, 30, what="the victim's breaker open")

        victim.start()  # back on the same port: the breaker's half-open probe finds it

        def closed() -> bool:
            httpx.post(
                f"{stack.url}/v1/completions", json={**LONG, "max_tokens": 2}, headers=auth("globex"), timeout=60
            ).raise_for_status()
            return stack.breakers()[victim.url] == "closed"

        poll(closed, 30, what="the victim's breaker closed again")
        stack.wait_idle()
    finally:
        stack.stop()
