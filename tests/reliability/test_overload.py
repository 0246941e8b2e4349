"""Overload, step by step: more requests than a gateway admits, mixed tenants and priorities, with every upstream
answer held until the test lets it through, so what is admitted, queued, shed and served, and in what order, is
decided by the gateway's rules alone and never by how fast this machine runs.

A gateway of its own (max_inflight_per_upstream 2, max_queue 6: 4 in flight + 6 queued) stands in front of the
shared stack's two real engines, each behind a gate: a pass-through proxy that holds every generation request
until the test lets that one through. The requests go out one at a time, each after the gateway has acted on the
last (a grant seen at a gate, a queue depth read back from /admin/policy, an answer): the 4 that fill the slots,
6 that fill the queue, then arrivals that each shed the newest waiter of the lowest band below their own, or are
shed themselves (`queue_full`), and one past its tenant's burst (429 `rate_limited`). Then the held requests are
let through one at a time, each freeing one slot for exactly one waiter: the order the waiters reach the gates is
the admission order (critical first, FIFO within a tenant). Every request gets exactly one answer; the engines
see each admitted request once and no refused one; every refusal is a 429/503 with Retry-After and its reason;
every 200 is PEFT's greedy text of the adapter it names. How much a stack serves under an open-loop overload is a
measurement, not a test: bench/overload.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from processes import serve_in_thread, start_gateway, stop_process
from rawhttp import Answer, post_json, request
from stack import ADMIN, GREEDY, PROMPT, REASONS, SCALE, Stack, auth, policy_yaml

INFLIGHT, QUEUE = 2, 6  # per upstream, and the gateway's queue: 2 x 2 + 6 = 10 admitted at once
ACME_BURST = 5  # acme's requests before its 6th is refused (a refill of one per 1000 s: none during the test)
POLICY = policy_yaml(
    max_inflight=INFLIGHT,
    max_queue=QUEUE,
    queue_timeout_ms=600_000,  # no waiter times out here: what happens is the queue's rules, not a clock's
    acme_limits=f"{{requests_per_second: 0.001, burst: {ACME_BURST}, tokens_per_minute: 100000000}}",
)
WAIT_S = 120.0  # how long any one step may take before the test gives up: a bound on a hang, never a measure
GENERATION = ("/v1/completions", "/v1/chat/completions")
_HOP = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"})
TENANT_OF = {"critical": "acme", "standard": "globex", "sheddable": "initech"}


@dataclass(frozen=True)
class Ask:
    name: str  # unique: sent as the body's `user`, which the engine ignores, so a gate can tell requests apart
    priority: str
    adapter: str | None

    @property
    def tenant(self) -> str:
        return TENANT_OF[self.priority]


# The 4 that fill the slots; acme's a0 is the first of its ACME_BURST requests.
FILL = [
    Ask("f0", "standard", "globex-a"),
    Ask("f1", "sheddable", None),
    Ask("f2", "critical", "acme-a"),
    Ask("f3", "sheddable", "acme-b"),
]
# The 6 that fill the queue: sheddable [s1 s2 s3], standard [t1 t2], critical [c1].
QUEUED = [
    Ask("s1", "sheddable", "globex-a"),
    Ask("s2", "sheddable", None),
    Ask("t1", "standard", None),
    Ask("s3", "sheddable", "acme-a"),
    Ask("t2", "standard", "globex-a"),
    Ask("c1", "critical", "acme-b"),
]
# Arrivals at a full queue, one at a time: (ask, the request refused by it, status, reason, queue depths after).
OVERFLOW: list[tuple[Ask, str, int, str, dict[str, int]]] = [
    # not above the lowest band (sheddable): the arrival itself is shed
    (Ask("o1", "sheddable", "globex-a"), "o1", 503, "queue_full", {"critical": 1, "standard": 2, "sheddable": 3}),
    # above it: the newest sheddable waiter is shed, the arrival queues
    (Ask("o2", "standard", "globex-a"), "s3", 503, "queue_full", {"critical": 1, "standard": 3, "sheddable": 2}),
    (Ask("o3", "critical", "acme-a"), "s2", 503, "queue_full", {"critical": 2, "standard": 3, "sheddable": 1}),
    (Ask("o4", "critical", None), "s1", 503, "queue_full", {"critical": 3, "standard": 3, "sheddable": 0}),
    # the lowest non-empty band is now standard: a standard arrival is shed, a critical one sheds o2
    (Ask("o5", "standard", None), "o5", 503, "queue_full", {"critical": 3, "standard": 3, "sheddable": 0}),
    (Ask("o6", "critical", "acme-b"), "o2", 503, "queue_full", {"critical": 4, "standard": 2, "sheddable": 0}),
    # acme's sixth request: past its burst, refused before admission (the queue is left as it was)
    (Ask("o7", "critical", "acme-a"), "o7", 429, "rate_limited", {"critical": 4, "standard": 2, "sheddable": 0}),
    # the lowest band is below nothing: a sheddable arrival is shed
    (Ask("o8", "sheddable", None), "o8", 503, "queue_full", {"critical": 4, "standard": 2, "sheddable": 0}),
]
# The order the waiters left in the queue get the slots freed one by one: critical first, FIFO within a tenant.
GRANTS = ["c1", "o3", "o4", "o6", "t1", "t2"]


class Gates:
    """One pass-through proxy per engine (uvicorn in a thread). A generation request is recorded (by the body's
    `user`) and held until `let_through(name)`; everything else (/v1/models, /load, /healthz) passes at once."""

    def __init__(self, engines: list[str]) -> None:
        self.engines = engines
        self.urls: list[str] = []
        self._arrived: list[str] = []
        self._through: set[str] = set()
        self._open = False
        self._lock = threading.Lock()
        self._serving = contextlib.ExitStack()

    def __enter__(self) -> Gates:
        for engine in self.engines:
            app = self._app(engine)
            self.urls.append(self._serving.enter_context(serve_in_thread(app, log_level="critical", lifespan="off")))
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._open = True
        self._serving.close()

    def arrivals(self) -> list[str]:
        """The generation requests that reached a gate, in the order they did (each once if nothing is sent
        twice)."""
        with self._lock:
            return list(self._arrived)

    def let_through(self, name: str) -> None:
        with self._lock:
            self._through.add(name)

    def _passes(self, name: str) -> bool:
        with self._lock:
            return self._open or name in self._through

    def _app(self, engine: str) -> Starlette:
        async def forward(req: Request) -> Response:
            body = await req.body()
            if req.method == "POST" and req.url.path in GENERATION:
                name = json.loads(body)["user"]
                with self._lock:
                    self._arrived.append(name)
                while not self._passes(name):
                    await asyncio.sleep(0.002)
            target = engine + req.url.path + (f"?{req.url.query}" if req.url.query else "")
            headers = [(k, v) for k, v in req.headers.items() if k.lower() not in _HOP]
            async with httpx.AsyncClient(timeout=300, trust_env=False) as client:
                answer = await client.request(req.method, target, content=body, headers=headers)
            kept = {k: v for k, v in answer.headers.items() if k.lower() not in _HOP}
            return Response(answer.content, answer.status_code, kept)

        return Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST", "PUT", "DELETE"])])


async def _until(condition: Callable[[], Awaitable[bool] | bool], what: str) -> None:
    """Wait until `condition` holds (re-checked every 10 ms); fail after WAIT_S (a hang, not a slow machine)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while True:
        held = condition()
        if held if isinstance(held, bool) else await held:
            return
        if loop.time() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        await asyncio.sleep(0.01)


class Scenario:
    def __init__(self, gateway: str, gates: Gates) -> None:
        self.gateway, self.gates = gateway, gates
        self.sent: dict[str, tuple[Ask, asyncio.Task[Answer]]] = {}

    def send(self, ask: Ask) -> asyncio.Task[Answer]:
        assert ask.name not in self.sent
        headers = {**auth(ask.tenant), "X-Priority": ask.priority}
        if ask.adapter is not None:
            headers["X-Adapter-ID"] = ask.adapter
        body = {"prompt": PROMPT, **GREEDY, "user": ask.name}
        call = post_json(self.gateway, "/v1/completions", body, headers, timeout_s=300, tag=ask)
        task = asyncio.create_task(call)
        self.sent[ask.name] = (ask, task)
        return task

    def answered(self) -> set[str]:
        return {name for name, (_, task) in self.sent.items() if task.done()}

    async def queues(self) -> dict[str, int]:
        answer = await request(self.gateway, "GET", "/admin/policy", headers=ADMIN, timeout_s=30)
        assert answer.status == 200, answer.body[:200]
        return answer.json()["queues"]

    async def depths_are(self, expected: dict[str, int]) -> bool:
        return await self.queues() == expected


async def _overload(gateway: str, gates: Gates) -> tuple[dict[str, Answer], list[str]]:
    """The scenario; (the answer to each request, by name; the order the queued ones reached a gate)."""
    run = Scenario(gateway, gates)
    # 1. Fill the slots: each admitted at once, held at a gate.
    for k, ask in enumerate(FILL, start=1):
        run.send(ask)
        await _until(lambda k=k: len(gates.arrivals()) == k, f"{ask.name} at a gate")
    assert gates.arrivals() == [a.name for a in FILL]
    # 2. Fill the queue.
    depths = {"critical": 0, "standard": 0, "sheddable": 0}
    for ask in QUEUED:
        run.send(ask)
        depths[ask.priority] += 1
        await _until(lambda want=dict(depths): run.depths_are(want), f"{ask.name} queued: {depths}")
    assert not run.answered(), run.answered()  # nobody answered yet: 4 held upstream, 6 waiting
    # 3. Overflow: each arrival refuses exactly one request, which is answered at once.
    for ask, refused, status, reason, after in OVERFLOW:
        before = run.answered()
        run.send(ask)
        await _until(lambda before=before: len(run.answered()) > len(before), f"a refusal on {ask.name}'s arrival")
        assert run.answered() - before == {refused}, (ask, run.answered() - before)
        answer = run.sent[refused][1].result()
        assert (answer.status, answer.headers.get("x-loragate-reason")) == (status, reason), (ask, answer.body)
        await _until(lambda after=after: run.depths_are(after), f"queue depths {after} after {ask.name}")
    assert gates.arrivals() == [a.name for a in FILL]  # no waiter reached an engine while every slot was taken
    # 4. Let the held requests through one at a time: each frees one slot, which goes to one waiter.
    grants: list[str] = []
    released: set[str] = set()
    while not all(task.done() for _, task in run.sent.values()):
        held = [name for name in gates.arrivals() if name not in released]
        assert held, f"nothing held upstream, yet {sorted(set(run.sent) - run.answered())} have no answer"
        released.add(held[0])
        arrived = len(gates.arrivals())
        gates.let_through(held[0])
        await _until(run.sent[held[0]][1].done, f"{held[0]}'s answer")
        if len(grants) < len(GRANTS):  # waiters remain: exactly one of them reaches a gate next
            await _until(lambda arrived=arrived: len(gates.arrivals()) > arrived, "the next waiter at a gate")
            grants.append(gates.arrivals()[arrived])
    return {name: task.result() for name, (_, task) in run.sent.items()}, grants


def test_overload_sheds_by_priority_and_gets_every_request_exactly_one_true_answer(
    stack: Stack, references: dict[str | None, str], tmp_path: Path
) -> None:
    for round_ in range(SCALE):
        with Gates([engine.url for engine in stack.engines]) as gates:
            proc, gateway = start_gateway(tmp_path, f"overload{round_}", POLICY, gates.urls)
            try:
                answers, grants = asyncio.run(_overload(gateway, gates))
                queues = asyncio.run(Scenario(gateway, gates).queues())
                routing = httpx.get(f"{gateway}/admin/policy", headers=ADMIN, timeout=30).json()["routing"]
            finally:
                stop_process(proc)
        _check(answers, grants, gates.arrivals(), references)
        assert queues == {"critical": 0, "standard": 0, "sheddable": 0}
        assert sum(u["inflight"] for u in routing["upstreams"]) == 0  # every slot given back
        stack.wait_idle()


def _check(
    answers: dict[str, Answer], grants: list[str], arrivals: list[str], references: dict[str | None, str]
) -> None:
    everyone = FILL + QUEUED + [ask for ask, *_ in OVERFLOW]
    refused = {name: (status, reason) for _, name, status, reason, _ in OVERFLOW}
    served = [ask.name for ask in everyone if ask.name not in refused]
    assert set(answers) == {ask.name for ask in everyone}  # one answer per request, none lost
    assert grants == GRANTS
    # The engines saw each admitted request exactly once, and no refused one.
    assert sorted(arrivals) == sorted(served) and len(set(arrivals)) == len(arrivals)
    for ask in everyone:
        answer = answers[ask.name]
        if ask.name in refused:
            assert (answer.status, answer.headers["x-loragate-reason"]) == refused[ask.name]
            assert answer.headers["x-loragate-reason"] in REASONS
            assert int(answer.headers["retry-after"]) >= 1, answer.headers
            assert answer.error_type == ("rate_limit_exceeded" if answer.status == 429 else "service_unavailable")
            continue
        assert answer.status == 200, (ask, answer.status, answer.body[:300])
        # Served under overload: still exactly PEFT's greedy text, from the adapter it names.
        assert answer.headers["x-loragate-adapter"] == (ask.adapter or answer.json()["model"])
        assert answer.json()["choices"][0]["text"] == references[ask.adapter], ask


def test_the_plan_follows_the_admission_rules() -> None:
    """The plan above keeps its own promises: unique names, acme's burst spent exactly at o7, and the refusals and
    grants it expects are what the documented rules give (a model of them: gateway/admission.py's docstring)."""
    scenario = FILL + QUEUED + [ask for ask, *_ in OVERFLOW]
    names = [ask.name for ask in scenario]
    assert len(set(names)) == len(names)
    acme = [ask.name for ask in scenario if ask.tenant == "acme"]
    assert acme.index("o7") == ACME_BURST
    bands: dict[str, list[str]] = {"critical": [], "standard": [], "sheddable": []}
    order = list(bands)
    for ask in QUEUED:
        bands[ask.priority].append(ask.name)
    for ask, refused, status, _, after in OVERFLOW:
        if status == 429:
            assert refused == ask.name
        else:
            lower = [band for band in order[order.index(ask.priority) + 1 :] if bands[band]]
            victim = bands[lower[-1]].pop() if lower else ask.name
            assert victim == refused, ask
            if lower:
                bands[ask.priority].append(ask.name)
        assert {band: len(queue) for band, queue in bands.items()} == after
    assert [name for band in order for name in bands[band]] == GRANTS
