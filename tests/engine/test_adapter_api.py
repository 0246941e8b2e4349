"""The adapter HTTP surface end to end: a real `loragate engine --adapter-dir` process on tiny-random,
with real PEFT adapters (tests/lora_fixtures.py), driven by the official `openai` client and raw httpx.

Also the demo adapters `loragate up` serves (engine/lora/demo.py), built on tiny-random, and the CLI flags.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.model.sources import build_tiny_random, load_tokenizer
from loragate.cli import build_parser, main

from lora_fixtures import load_peft_model, make_peft_adapter, peft_greedy
from processes import start_engine_server

MODEL = "tiny-random"
PROMPT = "The quick brown fox"
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
HOSTILE_IDS = ["../x", "a/b/c", "a@x", "x" * 10_000, "..", "/etc/passwd", ".hidden", "a\\b", "ü", "a b"]


def _start_server(log_path: Path, *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    return start_engine_server(log_path, "--max-model-len", "512", *extra, model=MODEL)


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """alpha and beta are registered at start; incoming/ (not an adapter itself) holds ones to POST."""
    root = tmp_path_factory.mktemp("adapters")
    make_peft_adapter(tiny_model_dir, root / "alpha", r=8, alpha=16, targets=["q_proj", "v_proj"], seed=1, b_std=0.5)
    make_peft_adapter(
        tiny_model_dir, root / "beta", r=4, alpha=8, targets=["o_proj", "gate_proj", "down_proj"], seed=2, b_std=0.5
    )
    make_peft_adapter(
        tiny_model_dir,
        root / "incoming" / "gamma",
        r=16,
        alpha=16,
        targets=["q_proj", "k_proj", "v_proj"],
        seed=3,
        b_std=0.5,
    )
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, adapter_root: Path) -> Iterator[str]:
    proc, base = _start_server(
        tmp_path_factory.mktemp("engine") / "engine.log",
        "--adapter-dir",
        str(adapter_root),
        "--max-device-adapters",
        "2",
    )
    yield base
    proc.terminate()
    proc.wait(timeout=60)


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=60)


def _complete(server: str, adapter: str | None = None, *, model: str = MODEL, **overrides: Any) -> httpx.Response:
    headers = {"X-Adapter-ID": adapter} if adapter is not None else {}
    body = {"model": model, "prompt": PROMPT, **GREEDY, **overrides}
    return httpx.post(f"{server}/v1/completions", json=body, headers=headers, timeout=60)


def _text(resp: httpx.Response) -> str:
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


def _adapters(server: str) -> dict[str, dict[str, Any]]:
    body = httpx.get(f"{server}/v1/adapters").json()
    assert body["object"] == "list"
    return {card["id"]: card for card in body["data"]}


def _load(server: str, body: Any) -> httpx.Response:
    return httpx.post(f"{server}/v1/adapters", json=body, timeout=60)


def _assert_error(resp: httpx.Response, status: int, type_: str, *needles: str) -> None:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/json"
    error = resp.json()["error"]
    assert error["type"] == type_
    assert len(error["message"]) < 1000  # a hostile input is never echoed whole
    for needle in needles:
        assert needle in error["message"], error["message"]


def _assert_still_serving(server: str) -> None:
    assert _complete(server, "alpha", max_tokens=2).status_code == 200
    assert _complete(server, max_tokens=2).status_code == 200


# ---- listing ---------------------------------------------------------------------------------------


def test_adapters_from_the_dir_are_listed(server: str, client: openai.OpenAI) -> None:
    cards = _adapters(server)
    assert {"alpha", "beta"} <= set(cards) and "incoming" not in cards
    alpha, beta = cards["alpha"], cards["beta"]
    assert (alpha["object"], alpha["rank"], alpha["target_modules"]) == ("adapter", 8, ["q_proj", "v_proj"])
    assert alpha["kind"] == beta["kind"] == "LoRA"
    assert (beta["rank"], beta["target_modules"]) == (4, ["o_proj", "gate_proj", "down_proj"])
    assert alpha["version"] >= 1 and alpha["parent"] == MODEL
    assert {c["residence"] for c in cards.values()} <= {"disk", "host", "device"}

    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids[0] == MODEL and {"alpha", "beta"} <= set(ids[1:])
    by_id = {m.id: m for m in models.data}
    assert by_id["alpha"].object == "model" and by_id["alpha"].parent == MODEL
    assert by_id[MODEL].parent is None


def test_residence_moves_to_device_on_use(server: str) -> None:
    _text(_complete(server, "beta", max_tokens=2))
    assert _adapters(server)["beta"]["residence"] == "device"


# ---- selection -------------------------------------------------------------------------------------


def test_adapter_output_matches_peft_and_model_equals_header(
    server: str, client: openai.OpenAI, adapter_root: Path, tiny_model_dir: Path
) -> None:
    base = _text(_complete(server))
    via_header = _complete(server, "alpha")
    via_model = _complete(server, model="alpha")
    assert _text(via_header) == _text(via_model) != base
    assert via_header.json()["model"] == via_model.json()["model"] == "alpha"
    # The reference: PEFT's own greedy decoding of the same adapter.
    tokenizer = load_tokenizer(tiny_model_dir)
    expected = peft_greedy(tiny_model_dir, adapter_root / "alpha", tokenizer(PROMPT)["input_ids"], GREEDY["max_tokens"])
    assert _text(via_header) == tokenizer.decode(expected)
    # The official client, both ways; the header wins over a different `model`.
    args = {"prompt": PROMPT, "temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}
    by_header = client.completions.create(model="beta", **args, extra_headers={"X-Adapter-ID": "alpha"})
    by_model = client.completions.create(model="alpha", **args)
    assert by_header.choices[0].text == by_model.choices[0].text == _text(via_header)
    beta = client.completions.create(model="beta", **args).choices[0].text
    assert beta not in (base, _text(via_header))


def test_chat_with_an_adapter(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    args = {"messages": messages, "temperature": 0, "max_tokens": 8, "extra_body": {"ignore_eos": True}}
    base = client.chat.completions.create(model=MODEL, **args)
    tuned = client.chat.completions.create(model=MODEL, extra_headers={"X-Adapter-ID": "beta"}, **args)
    assert tuned.model == "beta" and base.model == MODEL
    assert tuned.choices[0].message.content != base.choices[0].message.content


@pytest.mark.parametrize("adapter_id", HOSTILE_IDS + ["no-such-adapter"])
def test_unknown_or_hostile_adapter_is_404(server: str, adapter_id: str) -> None:
    if adapter_id.isascii():  # HTTP header values are latin-1; send the others in the body only
        _assert_error(_complete(server, adapter_id, max_tokens=2), 404, "adapter_not_found")
    _assert_error(_complete(server, model=adapter_id, max_tokens=2), 404, "adapter_not_found")


def test_hostile_ids_leave_the_server_serving(server: str) -> None:
    for adapter_id in HOSTILE_IDS:
        _complete(server, model=adapter_id, max_tokens=2)
    _assert_still_serving(server)


# ---- loading and unloading at run time ------------------------------------------------------------


def test_post_versions_and_delete(server: str, client: openai.OpenAI) -> None:
    base = _text(_complete(server))
    loaded = _load(server, {"id": "gamma", "path": "incoming/gamma"})
    assert loaded.status_code == 200, loaded.text
    card = loaded.json()
    assert (card["id"], card["version"], card["rank"]) == ("gamma", 1, 16)
    assert card["target_modules"] == ["q_proj", "k_proj", "v_proj"]
    assert _adapters(server)["gamma"]["version"] == 1
    assert "gamma" in [m.id for m in client.models.list().data]

    args = {"prompt": PROMPT, "temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}
    by_header = client.completions.create(model=MODEL, extra_headers={"X-Adapter-ID": "gamma"}, **args).choices[0].text
    by_model = client.completions.create(model="gamma", **args).choices[0].text
    assert by_header == by_model != base

    again = _load(server, {"id": "gamma", "path": "incoming/gamma"})
    assert again.status_code == 200 and again.json()["version"] == 2
    assert _text(_complete(server, "gamma")) == by_header  # same files, same output

    deleted = httpx.delete(f"{server}/v1/adapters/gamma")
    assert deleted.status_code == 200
    assert deleted.json() == {"id": "gamma", "object": "adapter", "deleted": True}
    assert "gamma" not in _adapters(server)
    assert "gamma" not in [m.id for m in client.models.list().data]
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gamma", **args)
    assert info.value.body["type"] == "adapter_not_found"
    _assert_error(httpx.delete(f"{server}/v1/adapters/gamma"), 404, "adapter_not_found", "gamma")

    reloaded = _load(server, {"id": "gamma", "path": "incoming/gamma"})
    assert reloaded.json()["version"] == 3  # a version is never reused, even after a delete
    httpx.delete(f"{server}/v1/adapters/gamma")


def test_post_without_path_loads_the_subdirectory_named_like_the_id(server: str, adapter_root: Path) -> None:
    shutil.copytree(adapter_root / "incoming" / "gamma", adapter_root / "delta")
    try:
        resp = _load(server, {"id": "delta"})
        assert resp.status_code == 200, resp.text
        assert _text(_complete(server, "delta")) != _text(_complete(server))
    finally:
        httpx.delete(f"{server}/v1/adapters/delta")
        shutil.rmtree(adapter_root / "delta")


def test_delete_unknown_is_404(server: str) -> None:
    _assert_error(httpx.delete(f"{server}/v1/adapters/never-loaded"), 404, "adapter_not_found")


@pytest.mark.parametrize(
    "path", ["/v1/adapters/a/b", "/v1/adapters/..%2Fx", "/v1/adapters/.x", "/v1/adapters/" + "x" * 10_000]
)
def test_delete_hostile_id_is_rejected(server: str, path: str) -> None:
    resp = httpx.delete(f"{server}{path}")
    assert resp.status_code in (400, 404), resp.text
    assert "error" in resp.json()
    assert {"alpha", "beta"} <= set(_adapters(server))


@pytest.mark.parametrize("adapter_id", HOSTILE_IDS + ["", 7, None])
def test_post_with_hostile_id_is_400(server: str, adapter_id: Any) -> None:
    _assert_error(_load(server, {"id": adapter_id, "path": "incoming/gamma"}), 400, "invalid_request_error", "id")


def test_post_with_path_outside_the_dir_is_400(
    server: str, adapter_root: Path, tmp_path: Path, tiny_model_dir: Path
) -> None:
    outside = make_peft_adapter(
        tiny_model_dir, tmp_path / "outside", r=4, alpha=4, targets=["q_proj"], seed=9, b_std=0.5
    )
    escape = adapter_root / "incoming" / "escape"
    escape.symlink_to(outside, target_is_directory=True)  # a link inside that leads outside
    try:
        for path in [
            "../../etc",
            "..",
            ".",
            "/etc",
            str(outside),
            str(adapter_root / ".." / "x"),
            "incoming/escape",
            "incoming/../../outside",
            "a\x00b",
        ]:
            _assert_error(_load(server, {"id": "evil", "path": path}), 400, "invalid_request_error", "path")
    finally:
        escape.unlink()
    assert "evil" not in _adapters(server)
    _assert_still_serving(server)


def test_post_with_a_file_symlinked_outside_is_400(
    server: str, adapter_root: Path, tmp_path: Path, tiny_model_dir: Path
) -> None:
    outside = make_peft_adapter(
        tiny_model_dir, tmp_path / "outside", r=4, alpha=4, targets=["q_proj"], seed=9, b_std=0.5
    )
    inside = adapter_root / "incoming" / "linked"
    inside.mkdir()
    try:
        shutil.copy(outside / "adapter_config.json", inside)
        (inside / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
        _assert_error(
            _load(server, {"id": "linked", "path": "incoming/linked"}), 400, "invalid_request_error", "symlink"
        )
    finally:
        shutil.rmtree(inside)
    _assert_still_serving(server)


@pytest.mark.parametrize(
    "body", [[1], {"path": "alpha"}, {"id": "x", "path": 5}, {"id": "x", "path": ""}, {"id": "x", "path": "p" * 5000}]
)
def test_post_with_a_malformed_body_is_400(server: str, body: Any) -> None:
    _assert_error(_load(server, body), 400, "invalid_request_error")


def test_corrupt_and_mismatched_adapters_are_400(
    server: str, adapter_root: Path, tmp_path: Path, tiny_model_dir: Path
) -> None:
    incoming = adapter_root / "incoming"
    corrupt = shutil.copytree(adapter_root / "alpha", incoming / "corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00garbage" * 100)
    other_base = build_tiny_random(tmp_path / "other-base", hidden_size=32, intermediate_size=64)
    make_peft_adapter(
        other_base, incoming / "mismatched", r=8, alpha=16, targets=["q_proj", "v_proj"], seed=4, b_std=0.5
    )
    no_config = shutil.copytree(adapter_root / "alpha", incoming / "no-config")
    (no_config / "adapter_config.json").unlink()
    try:
        _assert_error(
            _load(server, {"id": "corrupt", "path": "incoming/corrupt"}),
            400,
            "invalid_request_error",
            "corrupt",
            "safetensors",
        )
        _assert_error(
            _load(server, {"id": "mismatched", "path": "incoming/mismatched"}),
            400,
            "invalid_request_error",
            "mismatched",
            "shape",
        )
        _assert_error(
            _load(server, {"id": "nocfg", "path": "incoming/no-config"}),
            400,
            "invalid_request_error",
            "adapter_config.json",
        )
        _assert_error(
            _load(server, {"id": "missing", "path": "incoming/missing"}), 400, "invalid_request_error", "does not exist"
        )
        _assert_error(
            _load(server, {"id": "incoming", "path": "incoming"}), 400, "invalid_request_error", "adapter_config.json"
        )
    finally:
        for name in ("corrupt", "mismatched", "no-config"):
            shutil.rmtree(incoming / name)
    assert not {"corrupt", "mismatched", "nocfg", "missing", "incoming"} & set(_adapters(server))
    _assert_still_serving(server)


def _nan_copy(source: Path, dest: Path) -> Path:
    """A copy of an adapter whose lora_B weights are NaN: its config and header are fine, its data is not."""
    shutil.copytree(source, dest)
    tensors = load_file(str(dest / "adapter_model.safetensors"))
    tensors = {k: torch.full_like(v, float("nan")) if ".lora_B." in k else v for k, v in tensors.items()}
    save_file(tensors, str(dest / "adapter_model.safetensors"), metadata={"format": "pt"})
    return dest


def test_post_of_an_adapter_with_non_finite_weights_is_400(server: str, adapter_root: Path) -> None:
    _nan_copy(adapter_root / "alpha", adapter_root / "incoming" / "nan")
    try:
        _assert_error(
            _load(server, {"id": "nan", "path": "incoming/nan"}), 400, "invalid_request_error", "'nan'", "non-finite"
        )
    finally:
        shutil.rmtree(adapter_root / "incoming" / "nan")
    assert "nan" not in _adapters(server)
    _assert_still_serving(server)


def test_startup_confines_the_scan_and_a_poisoned_adapter_fails_alone(
    tmp_path: Path, adapter_root: Path, tiny_model_dir: Path
) -> None:
    """At startup only the header is read, so NaN weights surface at first use: that request gets a 500
    naming the adapter while the requests beside it finish with PEFT's tokens; a symlink out of the
    directory is refused as POST /v1/adapters refuses it."""
    root = tmp_path / "adapters"
    root.mkdir()
    shutil.copytree(adapter_root / "alpha", root / "alpha")
    _nan_copy(adapter_root / "alpha", root / "poisoned")
    outside = make_peft_adapter(tiny_model_dir, tmp_path / "outside", r=4, alpha=4, targets=["q_proj"], seed=9)
    (root / "escape").symlink_to(outside, target_is_directory=True)
    proc, base = _start_server(tmp_path / "engine.log", "--adapter-dir", str(root))
    try:
        assert set(_adapters(base)) == {"alpha", "poisoned"}

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=base, timeout=60) as http:

                def post(adapter: str | None, stream: bool = False) -> Any:
                    headers = {"X-Adapter-ID": adapter} if adapter else {}
                    return http.post(
                        "/v1/completions", headers=headers, json={"prompt": PROMPT, **GREEDY, "stream": stream}
                    )

                return list(
                    await asyncio.gather(
                        post("alpha"),
                        post("poisoned"),
                        post(None),
                        post("alpha"),
                        post("poisoned", stream=True),
                        post(None),
                    )
                )

        good_a, bad, good_base, good_a2, bad_stream, good_base2 = asyncio.run(burst())
        tokenizer = load_tokenizer(tiny_model_dir)
        prompt_ids = tokenizer(PROMPT)["input_ids"]
        alpha = tokenizer.decode(peft_greedy(tiny_model_dir, root / "alpha", prompt_ids, GREEDY["max_tokens"]))
        plain = tokenizer.decode(peft_greedy(tiny_model_dir, None, prompt_ids, GREEDY["max_tokens"]))
        assert _text(good_a) == _text(good_a2) == alpha
        assert _text(good_base) == _text(good_base2) == plain
        for resp in (bad, bad_stream):
            _assert_error(resp, 500, "adapter_error", "'poisoned'", "non-finite")
        # Remembered: the next request is refused at once, and the engine still serves everyone else.
        _assert_error(_complete(base, "poisoned", max_tokens=2), 500, "adapter_error", "non-finite")
        card = _adapters(base)["poisoned"]  # GET /v1/adapters says so, with the reason
        assert card["state"] == "failed" and "non-finite" in card["error"]
        assert _adapters(base)["alpha"]["state"] in ("disk", "host", "device")
        _assert_still_serving(base)
        assert httpx.get(f"{base}/readyz").status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert "escape" in (tmp_path / "engine.log").read_text()  # logged as skipped, with the reason


def test_load_and_unload_while_traffic_flows(server: str) -> None:
    """Streams on alpha, beta and the base keep going while gamma comes and goes and alpha reloads."""
    max_tokens = 400
    adapters = ("alpha", "beta", None, "alpha", "beta")
    started = [asyncio.Event() for _ in adapters]
    admin_done = asyncio.Event()
    chunks_after_admin = [0] * len(adapters)

    async def stream(http: httpx.AsyncClient, i: int) -> tuple[str, dict[str, Any]]:
        adapter = adapters[i]
        headers = {"X-Adapter-ID": adapter} if adapter else {}
        body = {
            "model": MODEL,
            "prompt": PROMPT,
            "temperature": 0,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        events = []
        async with http.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                    started[i].set()
                    chunks_after_admin[i] += admin_done.is_set()
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert not any("error" in c for c in chunks), chunks
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        return text, chunks[-1]["usage"]

    async def admin(http: httpx.AsyncClient) -> list[int]:
        await asyncio.gather(*(event.wait() for event in started))
        statuses = []
        for _ in range(3):
            for method, path, body in (
                ("POST", "/v1/adapters", {"id": "gamma", "path": "incoming/gamma"}),
                ("POST", "/v1/adapters", {"id": "alpha", "path": "alpha"}),
                ("GET", "/v1/adapters", None),
                ("DELETE", "/v1/adapters/gamma", None),
            ):
                statuses.append((await http.request(method, path, json=body)).status_code)
        admin_done.set()
        return statuses

    async def scenario() -> tuple[list[tuple[str, dict[str, Any]]], list[int]]:
        async with httpx.AsyncClient(base_url=server, timeout=120) as http:
            *results, statuses = await asyncio.gather(*(stream(http, i) for i in range(len(adapters))), admin(http))
        return results, statuses

    results, statuses = asyncio.run(scenario())
    assert statuses == [200] * len(statuses)
    assert sum(chunks_after_admin) > 0  # the streams really were in flight during the admin calls
    for text, usage in results:
        assert usage["completion_tokens"] == max_tokens
        assert text
    # Alpha was reloaded from the same files: every alpha stream saw the same weights.
    assert results[0][0] == results[3][0] == _text(_complete(server, "alpha", max_tokens=max_tokens))
    assert results[1][0] == results[4][0]
    assert results[0][0] != results[2][0] != results[1][0]
    assert "gamma" not in _adapters(server)


def test_adapter_metrics(server: str) -> None:
    _text(_complete(server, "alpha", max_tokens=2))
    text = httpx.get(f"{server}/metrics").text
    for name in (
        "loragate_engine_adapters_registered",
        "loragate_engine_adapters_on_device",
        "loragate_engine_adapter_pages_used",
        "loragate_engine_adapter_hits_total",
        "loragate_engine_adapter_misses_total",
        "loragate_engine_adapter_evictions_total",
        "loragate_engine_adapter_load_seconds_count",
    ):
        assert f"\n{name} " in text or f"\n{name}{{" in text, name  # evictions: by adapter


# ---- without --adapter-dir (in process: no subprocess needed) ----------------------------------------


def test_runtime_loading_needs_an_adapter_dir(tiny_model_dir: Path) -> None:
    from engine.config import EngineConfig
    from engine.core.async_engine import AsyncEngine
    from engine.core.llm_engine import LLMEngine
    from engine.entrypoints.server import build_app

    app = build_app(AsyncEngine(LLMEngine(EngineConfig(dtype="float32", model=MODEL, max_model_len=256))))

    async def scenario() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as http:
            return [
                await http.post("/v1/adapters", json={"id": "x", "path": "x"}),
                await http.get("/v1/adapters"),
                await http.get("/v1/models"),
                await http.delete("/v1/adapters/x"),
            ]

    load, listed, models, delete = asyncio.run(scenario())
    _assert_error(load, 400, "invalid_request_error", "--adapter-dir")
    assert listed.json() == {"object": "list", "data": []}
    assert [m["id"] for m in models.json()["data"]] == [MODEL]
    _assert_error(delete, 404, "adapter_not_found")


# ---- the CLI ---------------------------------------------------------------------------------------


def test_engine_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["engine", "--model", MODEL])
    assert (args.adapter_dir, args.max_device_adapters, args.host_adapter_mb) == (None, 8, 512)
    args = build_parser().parse_args(
        [
            "engine",
            "--model",
            MODEL,
            "--adapter-dir",
            str(tmp_path),
            "--max-device-adapters",
            "3",
            "--host-adapter-mb",
            "0",
        ]
    )
    assert (Path(args.adapter_dir), args.max_device_adapters, args.host_adapter_mb) == (tmp_path.resolve(), 3, 0)
    for bad in (
        ["--adapter-dir", str(tmp_path / "missing")],
        ["--max-device-adapters", "0"],
        ["--host-adapter-mb", "-1"],
    ):
        with pytest.raises(SystemExit) as info:
            main(["engine", "--model", MODEL, *bad])
        assert info.value.code == 2
    assert "not an existing directory" in capsys.readouterr().err


def test_up_banner_names_the_adapters() -> None:
    from loragate.up_cli import _banner

    banner = _banner("http://127.0.0.1:8000", ["french", "mine", "pirate"], "dev-k", "admin-k")
    assert "ops page: http://127.0.0.1:8000/admin/ui   admin key (new every run): admin-k" in banner
    assert "pirate       answers like a pirate" in banner and "\n  mine\n" in banner
    assert "-H 'X-Adapter-ID: pirate'" in banner and "http://127.0.0.1:8000/v1/chat/completions" in banner
    assert "X-Adapter-ID" not in _banner("http://127.0.0.1:8000", [])


# ---- the demo adapters -------------------------------------------------------------------------------


def test_demo_adapters_are_peft_loras_that_change_the_output(tmp_path: Path, tiny_model_dir: Path) -> None:
    from engine.lora.demo import DEMOS, build_demo_adapters

    written = build_demo_adapters(tiny_model_dir, tmp_path, steps=3)
    assert [p.name for p in written] == [d.adapter_id for d in DEMOS]
    prompt = load_tokenizer(tiny_model_dir)("Tell me about the moon.")["input_ids"]
    with torch.no_grad():
        base = load_peft_model(tiny_model_dir, None)(torch.tensor([prompt])).logits
    for path in written:
        config = json.loads((path / "adapter_config.json").read_text())
        assert (config["peft_type"], config["r"]) == ("LORA", 8)
        assert sorted(config["target_modules"]) == ["q_proj", "v_proj"]
        weights = load_file(path / "adapter_model.safetensors")
        assert all(t.abs().sum() > 0 for k, t in weights.items() if "lora_B" in k)  # trained
        with torch.no_grad():  # PEFT itself loads it, and it changes the logits
            tuned = load_peft_model(tiny_model_dir, path)(torch.tensor([prompt])).logits
        assert not torch.allclose(tuned, base, atol=1e-4)


def test_demo_adapter_dir_is_built_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path) -> None:
    import engine.lora.demo as demo

    monkeypatch.setenv("LORAGATE_CACHE", str(tmp_path))
    monkeypatch.setattr(demo, "resolve_model", lambda spec: SimpleNamespace(path=tiny_model_dir))
    built = demo.demo_adapter_dir("tiny-random", steps=1)
    assert built.parent == tmp_path and sorted(p.name for p in built.iterdir()) == sorted(
        d.adapter_id for d in demo.DEMOS
    )
    assert [p.name for p in tmp_path.iterdir()] == [built.name]  # no temporary left behind

    def must_not_build(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("rebuilt a cached entry")

    monkeypatch.setattr(demo, "build_demo_adapters", must_not_build)
    assert demo.demo_adapter_dir("tiny-random") == built
    with pytest.raises(ValueError, match="--adapter-dir"):
        demo.demo_adapter_dir("/some/other/model")
