"""Weighted mixes of adapters (engine/lora/mixes.py) against PEFT's own `add_weighted_adapter(..., "cat")`.

The reference is PEFT: each part loaded by PeftModel from its saved directory, the mix made by PEFT, greedy decoding
by HF `generate` with its raw logits. The engine runs mixes of two and three parts (ranks 4, 8 and 16, different
target modules, an rsLoRA part, a negative weight) in one batch with a plain LoRA row and a base row, through each
LoRA route (C++ ops, torch twins, Triton under its interpreter), once on SmolLM2, and through the HTTP API with the
official `openai` client (a mix in X-Adapter-ID and in the body's `adapter_mix`, and a catalog part fetched from
the sources in X-Adapter-Part-Sources). Refusals are JSON errors naming the problem, and the engine keeps serving.

PEFT's "cat" mix takes the first adapter's LoraConfig for the new one (r = lora_alpha = the summed rank): with
use_rslora there its scale is not 1 but sqrt(rank), so the references list a plain LoRA first (the engine's mix is
the exact weighted sum whatever the order).
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from peft import PeftModel
from prometheus_client.parser import text_string_to_metric_families

from engine.config import EngineConfig
from engine.core.llm_engine import AdapterUnusable, LLMEngine
from engine.core.request import Request, SamplingParams
from engine.lora.peft_config import AdapterError
from engine.model.sources import load_tokenizer
from loragate_common.adapter_mix import MAX_PARTS, PART_SOURCES_HEADER
from loragate_kernels.backends import Machine

from adapter_servers import sha256sum_digest
from lora_fixtures import hf_base_model, make_peft_adapter
from processes import start_engine_server

NEW_TOKENS = 4
TOP = 5  # logprobs compared per step
ADAPTERS: dict[str, dict[str, Any]] = {
    "qv": dict(r=4, alpha=8, targets=["q_proj", "v_proj"], seed=11),
    "all": dict(r=8, alpha=16, targets="all-linear", seed=12),
    "mlp": dict(r=16, alpha=8, targets=["gate_proj", "up_proj", "down_proj"], use_rslora=True, seed=13),
}
# name -> weights, in the order PEFT gets them (a plain LoRA first: see the module docstring)
MIX2 = {"qv": 0.7, "all": 0.3}
MIX3 = {"all": -0.4, "qv": 0.5, "mlp": 0.8}
Ref = str | dict[str, float] | None  # the base model, one adapter, or a mix


def header(mix: dict[str, float], reverse: bool = False) -> str:
    """The mix as X-Adapter-ID writes it, parts in the given order (or reversed)."""
    items = list(mix.items())
    return "+".join(f"{name}*{weight}" for name, weight in (items[::-1] if reverse else items))


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mix-adapters")
    for name, kwargs in ADAPTERS.items():
        make_peft_adapter(tiny_model_dir, root / name, b_std=0.3, **kwargs)
    return root


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 250) for _ in range(n)] for n in (6, 13, 21)]


def peft_model(base_dir: Path, dirs: dict[str, Path], ref: Ref) -> torch.nn.Module:
    """The HF model with PEFT's adapter (`ref` names one) or PEFT's "cat" mix of `ref`'s parts, weights in order."""
    model = hf_base_model(base_dir)
    if ref is None:
        return model.eval()
    names = [ref] if isinstance(ref, str) else list(ref)
    peft = PeftModel.from_pretrained(model, str(dirs[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        peft.load_adapter(str(dirs[name]), adapter_name=name)
    if isinstance(ref, dict):
        peft.add_weighted_adapter(names, [ref[n] for n in names], "mix", combination_type="cat")
        peft.set_adapter("mix")
    return peft.eval()


def peft_run(model: torch.nn.Module, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """PEFT + HF greedy decoding of `n` tokens: the tokens and each step's log-softmax of the raw logits."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(prompt) :].tolist(), [torch.log_softmax(x[0].float(), -1) for x in out.logits]


def references(base_dir: Path, dirs: dict[str, Path], jobs: list[tuple[Ref, int]], prompts: list[list[int]]) -> list:
    models: dict[str, torch.nn.Module] = {}
    out = []
    for ref, i in jobs:
        key = json.dumps(ref)
        if key not in models:
            models[key] = peft_model(base_dir, dirs, ref)
        out.append(peft_run(models[key], prompts[i], NEW_TOKENS))
    return out


def engine_name(ref: Ref, reverse: bool = False) -> str | None:
    return header(ref, reverse) if isinstance(ref, dict) else ref


def run(engine: LLMEngine, jobs: list[tuple[str | None, list[int]]], n: int = NEW_TOKENS) -> list[Request]:
    """Every job in one batch, to completion."""
    params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True, logprobs=TOP)
    requests = [engine.add_request(f"j{i}", prompt, params, adapter_id=name) for i, (name, prompt) in enumerate(jobs)]
    while engine.has_unfinished_requests():
        engine.step()
    return requests


def assert_matches(request: Request, expected: tuple[list[int], list[torch.Tensor]], what: str) -> None:
    """Greedy tokens equal, and every step's top logprobs equal PEFT's log-softmax at those tokens."""
    tokens, logprobs = expected
    assert request.output_token_ids == tokens, what
    assert len(request.output_logprobs) == len(logprobs)
    for step, (ours, theirs) in enumerate(zip(request.output_logprobs, logprobs, strict=True)):
        ids = [token for token, _ in ours.top]
        got = torch.tensor([value for _, value in ours.top])
        torch.testing.assert_close(got, theirs[ids], rtol=0, atol=2e-4, msg=f"{what}, step {step}")


# ---- equal to PEFT ------------------------------------------------------------------------------------------

JOBS: list[tuple[Ref, int]] = [(None, 0), ("all", 1), (MIX2, 2), (MIX3, 0)]


@pytest.fixture(scope="module")
def expected(tiny_model_dir: Path, adapter_dir: Path, prompts: list[list[int]]) -> list:
    dirs = {name: adapter_dir / name for name in ADAPTERS}
    return references(tiny_model_dir, dirs, JOBS, prompts)


def test_the_references_differ(expected: list) -> None:
    """The mixes change the output (the comparisons below are not base against base), and each other's."""
    tokens = [t for t, _ in expected]
    assert len({tuple(t) for t in tokens}) == len(tokens)


@pytest.mark.parametrize("route", ["cpp", "torch", "triton"])
def test_mixes_in_a_mixed_batch_equal_peft_on_each_route(
    route: str, adapter_dir: Path, prompts: list[list[int]], expected: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    if route == "cpp" and not Machine.probe("cpu").cpu_ops:
        pytest.skip(f"the C++ ops did not build here: {Machine.probe('cpu').cpu_ops_problem}")
    monkeypatch.setenv("LORAGATE_LORA_BACKEND", route)
    engine = LLMEngine(EngineConfig(dtype="float32", model="tiny-random", adapter_dir=str(adapter_dir)))
    assert engine.backends.lora.value == route
    engine.device_adapters.stage_copies = route == "triton"  # a GPU engine's way of loading adapters
    jobs = [(engine_name(ref, reverse=True), prompts[i]) for ref, i in JOBS]
    requests = run(engine, jobs)
    for request, job, want in zip(requests, JOBS, expected, strict=True):
        assert_matches(request, want, f"{route}: {job}")
    assert requests[2].adapter_id == "all*0.3+qv*0.7"  # the canonical name, whatever the order it was named in
    assert requests[3].adapter is not None and requests[3].adapter.max_rank == 8 + 16  # all + mlp on the MLP


def test_one_derived_adapter_per_mix_and_a_new_one_per_part_version(
    tiny_model_dir: Path, adapter_dir: Path, prompts: list[list[int]], expected: list, tmp_path: Path
) -> None:
    engine = LLMEngine(EngineConfig(dtype="float32", model="tiny-random", adapter_dir=str(adapter_dir)))
    first = engine.resolve_adapter(header(MIX2))
    assert engine.resolve_adapter(header(MIX2, reverse=True)) is first
    assert first.adapter_id == "all*0.3+qv*0.7" and [p.adapter_id for p, _ in first.parts] == ["all", "qv"]
    loads = engine.device_adapters.counters.loads
    requests = run(engine, [(header(MIX2), prompts[2]), (header(MIX2, reverse=True), prompts[2])])
    assert engine.device_adapters.counters.loads == loads + 1  # one derived adapter on the device for both
    for request in requests:
        assert request.adapter is first
        assert_matches(request, expected[2], "mix")
    assert engine.adapter_residence(first.adapter_id) == "device"
    assert all(spec.adapter_id != first.adapter_id for spec in engine.adapters.list())  # never registered

    # "qv" registered again, with other weights: the mix is a new adapter under the same name.
    new_qv = make_peft_adapter(tiny_model_dir, tmp_path / "qv2", b_std=0.3, **{**ADAPTERS["qv"], "seed": 99})
    engine.adapters.register("qv", new_qv)
    engine.retire_adapter("qv")
    assert not engine.device_adapters.is_resident(first) and not engine.host_adapters.contains(first)
    second = engine.resolve_adapter(header(MIX2))
    assert second.adapter_id == first.adapter_id and second.key != first.key
    dirs = {"qv": new_qv, "all": adapter_dir / "all"}
    want = references(tiny_model_dir, dirs, [(MIX2, 2)], prompts)[0]
    assert want[0] != expected[2][0]  # the new weights change the mix's output
    (request,) = run(engine, [(header(MIX2), prompts[2])])
    assert request.adapter is second
    assert_matches(request, want, "mix after its part was registered again")

    # A part unloaded: the mix is gone with it (404 naming the part at the HTTP layer).
    engine.adapters.unregister("all")
    engine.retire_adapter("all")
    assert not engine.device_adapters.is_resident(second)
    with pytest.raises(KeyError, match="'all'"):
        engine.resolve_adapter(header(MIX2))


def test_a_part_whose_files_broke_fails_its_mixes_alone(adapter_dir: Path, prompts: list[list[int]], tmp_path: Path):
    """A part's weights file replaced after it was registered: the mix's request fails naming the part, that part
    version is remembered as broken (never the mix: clients make mix names up), and the batch beside it runs on."""
    shutil.copytree(adapter_dir, tmp_path / "adapters")
    engine = LLMEngine(EngineConfig(dtype="float32", model="tiny-random", adapter_dir=str(tmp_path / "adapters")))
    weights = tmp_path / "adapters" / "qv" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes())  # the same bytes, another file: its stamp no longer matches
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    mixed = engine.add_request("mixed", prompts[0], params, adapter_id=header(MIX2))
    beside = engine.add_request("beside", prompts[1], params, adapter_id="all")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    (failed,) = [out for out in outputs if out.error is not None]
    assert failed.request_id == "mixed" and "'qv'" in failed.error.message and "changed on disk" in failed.error.message
    assert len(beside.output_token_ids) == NEW_TOKENS
    qv = engine.adapters.get("qv")
    assert engine.adapters.broken(qv) is not None and mixed.adapter is not None
    assert engine.adapters.broken(mixed.adapter) is None
    with pytest.raises(AdapterUnusable, match="changed on disk"):
        engine.add_request("again", prompts[0], params, adapter_id="qv*0.1+mlp*2")


def test_a_mix_larger_than_the_pool_is_refused(adapter_dir: Path, prompts: list[list[int]]) -> None:
    engine = LLMEngine(EngineConfig(dtype="float32", model="tiny-random", adapter_dir=str(adapter_dir)))
    mix = engine.resolve_adapter(header(MIX3))
    tier = engine.device_adapters
    largest_part = max(tier.pages_needed(part) for part, _ in mix.parts)
    assert tier.pages_needed(mix) > largest_part + 1
    small = LLMEngine(
        EngineConfig(
            dtype="float32", model="tiny-random", adapter_dir=str(adapter_dir), num_kv_blocks=tier.pages_needed(mix) - 1
        )
    )
    with pytest.raises(AdapterError, match="pool"):
        small.resolve_adapter(header(MIX3))
    (request,) = run(small, [("mlp", prompts[0])])  # a part alone still fits and runs
    assert len(request.output_token_ids) == NEW_TOKENS


@pytest.mark.smollm2
def test_a_mix_on_smollm2_equals_peft(smollm2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not Machine.probe("cpu").cpu_ops:
        pytest.skip(f"the C++ ops did not build here: {Machine.probe('cpu').cpu_ops_problem}")
    monkeypatch.setenv("LORAGATE_LORA_BACKEND", "cpp")
    specs = {
        "s4": dict(r=4, alpha=8, targets=["q_proj", "v_proj", "o_proj"]),
        "s8": dict(r=8, alpha=16, targets=["k_proj", "down_proj", "up_proj"], use_rslora=True),
    }
    for seed, (name, kwargs) in enumerate(specs.items()):
        make_peft_adapter(smollm2_dir, tmp_path / name, seed=seed, b_std=0.05, **kwargs)
    engine = LLMEngine(EngineConfig(dtype="float32", model="smollm2", adapter_dir=str(tmp_path), pool_mb=192))
    prompt = engine.tokenizer("The quick brown fox jumps over")["input_ids"]
    mix = {"s4": 0.8, "s8": -0.6}
    (request,) = run(engine, [(header(mix), prompt)])
    dirs = {name: tmp_path / name for name in specs}
    want = peft_run(peft_model(smollm2_dir, dirs, mix), prompt, NEW_TOKENS)
    assert_matches(request, want, "smollm2 mix")
    base = peft_run(peft_model(smollm2_dir, dirs, None), prompt, NEW_TOKENS)
    assert (want[1][0] - base[1][0]).abs().max() > 0.5  # the mix changes the logits (the check above is no base check)


# ---- through the HTTP API -----------------------------------------------------------------------------------

BASE = "tiny-random"
PROMPT_TEXT = "The quick brown fox"
CATALOG_PART = "tone@1"  # registered from its source on the request that names it


@pytest.fixture(scope="module")
def catalog_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("catalog")
    make_peft_adapter(tiny_model_dir, root / "tone", r=8, alpha=8, targets=["o_proj", "k_proj"], seed=21, b_std=0.3)
    return root


@pytest.fixture(scope="module")
def served_dir(tmp_path_factory: pytest.TempPathFactory, adapter_dir: Path) -> Path:
    """The server's --adapter-dir: the test adapters, and room for more loaded at run time."""
    served = tmp_path_factory.mktemp("served") / "adapters"
    shutil.copytree(adapter_dir, served)
    return served


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, served_dir: Path, catalog_dir: Path) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("mix-engine")
    proc, base = start_engine_server(
        tmp / "engine.log",
        "--adapter-dir",
        str(served_dir),
        "--adapter-cache-dir",
        str(tmp / "cache"),
        "--adapter-source-allow",
        str(catalog_dir),
        "--max-model-len",
        "256",
    )
    yield base
    proc.terminate()
    proc.wait(timeout=60)


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=60)


GREEDY: dict[str, Any] = {"ignore_eos": True, "min_tokens": NEW_TOKENS}


def expected_text(base_dir: Path, dirs: dict[str, Path], ref: Ref) -> str:
    tokenizer = load_tokenizer(base_dir)
    tokens, _ = peft_run(peft_model(base_dir, dirs, ref), tokenizer(PROMPT_TEXT)["input_ids"], NEW_TOKENS)
    return tokenizer.decode(tokens)


def complete(server: str, headers: dict[str, str] | None = None, **body: Any) -> httpx.Response:
    payload = {"model": BASE, "prompt": PROMPT_TEXT, "max_tokens": NEW_TOKENS, "temperature": 0, **GREEDY, **body}
    return httpx.post(f"{server}/v1/completions", json=payload, headers=headers or {}, timeout=60)


def assert_error(resp: httpx.Response, status: int, type_: str, *needles: str) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["type"] == type_, error
    for needle in needles:
        assert needle in error["message"], error["message"]


def metric(server: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{server}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise AssertionError(f"no sample {name}{labels}")


def test_header_and_body_forms_through_the_openai_client(
    server: str, client: openai.OpenAI, tiny_model_dir: Path, adapter_dir: Path
) -> None:
    dirs = {name: adapter_dir / name for name in ADAPTERS}
    want = expected_text(tiny_model_dir, dirs, MIX3)
    by_header = client.completions.create(
        model=BASE,
        prompt=PROMPT_TEXT,
        max_tokens=NEW_TOKENS,
        temperature=0,
        extra_headers={"X-Adapter-ID": header(MIX3, reverse=True)},
        extra_body=GREEDY,
    )
    by_body = client.completions.create(
        model=BASE,
        prompt=PROMPT_TEXT,
        max_tokens=NEW_TOKENS,
        temperature=0,
        extra_body={**GREEDY, "adapter_mix": MIX3},
    )
    name = "all*-0.4+mlp*0.8+qv*0.5"
    for answer in (by_header, by_body):
        assert answer.choices[0].text == want
        assert answer.model == name
    chat = client.chat.completions.create(
        model=BASE,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        extra_body={"adapter_mix": MIX2},
    )
    assert chat.model == "all*0.3+qv*0.7"
    assert metric(server, "loragate_engine_adapter_generation_tokens_total", adapter=name) == 2 * NEW_TOKENS
    assert metric(server, "loragate_engine_adapter_loads_total", adapter=name) == 1
    assert name in httpx.get(f"{server}/load", timeout=10).json()["device_adapters"]
    ids = {card["id"] for card in httpx.get(f"{server}/v1/adapters", timeout=10).json()["data"]}
    assert set(ADAPTERS) <= ids and name not in ids  # a mix is no registered adapter
    assert name not in {m.id for m in client.models.list()}


def test_a_catalog_part_is_fetched_from_the_part_sources(
    server: str, tiny_model_dir: Path, adapter_dir: Path, catalog_dir: Path
) -> None:
    tone = catalog_dir / "tone"
    sources = [{"ref": CATALOG_PART, "source": str(tone), "sha256": sha256sum_digest(tone), "size": None}]
    headers = {"X-Adapter-ID": f"qv*0.6+{CATALOG_PART}*-0.7", PART_SOURCES_HEADER: json.dumps(sources)}
    resp = complete(server, headers)
    assert resp.status_code == 200, resp.text
    want = expected_text(tiny_model_dir, {"qv": adapter_dir / "qv", "tone": tone}, {"qv": 0.6, "tone": -0.7})
    assert resp.json()["choices"][0]["text"] == want
    assert resp.json()["model"] == f"qv*0.6+{CATALOG_PART}*-0.7"
    cards = {card["id"]: card for card in httpx.get(f"{server}/v1/adapters", timeout=10).json()["data"]}
    assert cards[CATALOG_PART]["sha256"] == sources[0]["sha256"]


def test_refusals_name_the_problem_and_the_engine_keeps_serving(server: str) -> None:
    mix = header(MIX2)
    assert_error(complete(server, {"X-Adapter-ID": "qv*0.5+nope*0.5"}), 404, "adapter_not_found", "'nope'")
    assert_error(complete(server, model="qv*0.5+nope@3*0.5"), 404, "adapter_not_found", "'nope@3'")
    assert_error(complete(server, {"X-Adapter-ID": "qv*nan+all*0.3"}), 400, "invalid_request_error", "X-Adapter-ID")
    assert_error(complete(server, model="qv*inf"), 400, "invalid_request_error", "model", "finite")
    assert_error(complete(server, adapter_mix={"qv": 0.5, "all": 0}), 400, "invalid_request_error", "adapter_mix")
    inf_body = b'{"prompt": "x", "max_tokens": 1, "adapter_mix": {"qv": 1e999}}'
    resp = httpx.post(f"{server}/v1/completions", content=inf_body, timeout=60)
    assert_error(resp, 400, "invalid_request_error", "adapter_mix")
    many = "+".join(f"p{i}*0.1" for i in range(MAX_PARTS + 1))
    assert_error(complete(server, {"X-Adapter-ID": many}), 400, "invalid_request_error", f"at most {MAX_PARTS}")
    assert_error(complete(server, {"X-Adapter-ID": mix}, adapter_mix=MIX2), 400, "invalid_request_error", "adapter_mix")
    assert_error(complete(server, adapter_mix=MIX2, model="qv"), 400, "invalid_request_error", "adapter_mix")
    sha = "a" * 64
    good = {"ref": "qv@1", "source": "/nowhere", "sha256": sha, "size": None}
    for value, needle in (
        ("not json", "not valid JSON"),
        ("{}", "list"),
        ("[" * 5000 + "]" * 5000, PART_SOURCES_HEADER),
        (json.dumps([{**good, "ref": "qv"}]), "ID@N"),
        (json.dumps([{**good, "ref": "other@1"}]), "not a part of the mix"),
        (json.dumps([{**good, "sha256": "xyz"}]), "sha256"),
        (json.dumps([{**good, "size": -1}]), "size"),
        (json.dumps([{**good, "extra": 1}]), "extra"),
        (json.dumps([good, good]), "twice"),
        (json.dumps([{**good, "source": "s" * 3000}]), PART_SOURCES_HEADER),
    ):
        headers = {"X-Adapter-ID": "qv@1*0.5+all*0.5", PART_SOURCES_HEADER: value}
        assert_error(complete(server, headers), 400, "invalid_request_error", needle)
    single_source = {"X-Adapter-ID": mix, "X-Adapter-Source": "/nowhere", "X-Adapter-SHA256": sha}
    assert_error(complete(server, single_source), 400, "invalid_request_error", PART_SOURCES_HEADER)
    one_adapter = {"X-Adapter-ID": "qv", PART_SOURCES_HEADER: json.dumps([good])}
    assert_error(complete(server, one_adapter), 400, "invalid_request_error", PART_SOURCES_HEADER)
    assert complete(server, {"X-Adapter-ID": mix}).status_code == 200
    assert complete(server).status_code == 200


def unmixable_part(server: str, served_dir: Path, base_dir: Path, name: str, **kwargs: Any) -> None:
    """Save a PEFT adapter in the server's adapter directory and load it; skip where the engine does not serve such
    adapters at all yet (then no mix can hold one)."""
    make_peft_adapter(base_dir, served_dir / name, r=4, alpha=8, seed=5, b_std=0.3, **kwargs)
    resp = httpx.post(f"{server}/v1/adapters", json={"id": name}, timeout=60)
    if resp.status_code == 400:
        pytest.skip(f"the engine refuses such an adapter alone, so no mix can hold one: {resp.json()['error']}")
    assert resp.status_code == 200, resp.text


def test_a_dora_part_is_refused(server: str, served_dir: Path, tiny_model_dir: Path) -> None:
    unmixable_part(server, served_dir, tiny_model_dir, "dora", targets=["q_proj", "v_proj"], use_dora=True)
    resp = complete(server, {"X-Adapter-ID": "qv*0.5+dora*0.5"})
    assert_error(resp, 400, "invalid_request_error", "'dora'", "DoRA")
    assert complete(server, {"X-Adapter-ID": "qv*0.5+all*0.5"}).status_code == 200


def test_a_part_with_lora_on_the_embedding_is_refused(server: str, served_dir: Path, tiny_model_dir: Path) -> None:
    unmixable_part(server, served_dir, tiny_model_dir, "embed", targets=["q_proj", "embed_tokens"])
    resp = complete(server, adapter_mix={"embed": 0.5, "qv": 0.5})
    assert_error(resp, 400, "invalid_request_error", "'embed'", "not mixable yet")
    assert complete(server, {"X-Adapter-ID": "qv*0.5+all*0.5"}).status_code == 200
