"""LoRA on embed_tokens and lm_head (engine/lora/vocab_lora.py) through the whole engine, against PEFT (PeftModel on
the HF model, one request at a time): in one batch with plain LoRA and base rows on every LoRA route, on untied and
tied bases (PEFT's default independent LoRAs, and ensure_weight_tying's tied head), Gemma 3's scaled embeddings,
prompt logprobs, the copies of the base's matrices PEFT saves beside them, and hostile files."""

from __future__ import annotations

import functools
import json
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from model_families import build_family
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import GenerationConfig

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.request import Request, SamplingParams
from engine.lora.peft_config import VOCAB_MODULES, AdapterError, module_name, parse_config, plan_vocab
from engine.model.config import load_model_config
from engine.model.sources import build_tiny_random, load_tokenizer
from engine.worker.cuda_graphs import EagerGraph
from loragate_kernels.backends import Machine

from lora_fixtures import hf_base_model, load_peft_model, make_peft_adapter, peft_greedy
from processes import start_engine_server

TOKENS = 6
EMBED_KEY = "base_model.model.model.embed_tokens.lora_embedding"
COPY_KEY = "base_model.model.model.embed_tokens.base_layer.weight"
# name -> LoraConfig arguments, on an untied base
ADAPTERS: dict[str, dict[str, Any]] = {
    "embed": dict(r=4, alpha=8, targets=["embed_tokens"]),
    "head": dict(r=8, alpha=16, targets=["lm_head"], use_rslora=True),
    "mixed": dict(
        r=4, alpha=8, targets=["embed_tokens", "lm_head", "q_proj", "down_proj"], rank_pattern={"lm_head": 6}
    ),
    "plain": dict(r=8, alpha=16, targets=["q_proj", "v_proj"]),
}


def _adapters(base: Path, root: Path, specs: dict[str, dict[str, Any]]) -> Path:
    for seed, (name, kwargs) in enumerate(specs.items()):
        make_peft_adapter(base, root / name, seed=seed, b_std=0.3, **kwargs)
    return root


@pytest.fixture(scope="module")
def untied(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _adapters(tiny_model_dir, tmp_path_factory.mktemp("untied"), ADAPTERS)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(4)
    return [[rng.randrange(3, 460) for _ in range(n)] for n in (6, 13)]


def peft_logits(base: Path, adapter: Path | None, prompt: list[int]) -> torch.Tensor:
    """[n, vocab]: PEFT's fp32 logits at every prompt position."""
    model = load_peft_model(base, adapter)
    with torch.no_grad():
        return model(input_ids=torch.tensor([prompt])).logits[0].float()


class FirstLogits:
    """Wraps the runner's sampler: the logits each request is first sampled from (its prompt's last position), with
    every LoRA the runner adds to them."""

    def __init__(self, engine: LLMEngine) -> None:
        self.sampler, self.first = engine.runner.sampler, {}
        engine.runner.sampler = self  # type: ignore[assignment]

    def __call__(self, logits: torch.Tensor, requests: list[Request], tables: Any) -> Any:
        for row, request in zip(logits, requests, strict=True):
            self.first.setdefault(request.request_id, row.detach().float().clone())
        return self.sampler(logits, requests, tables)


def run(engine: LLMEngine, jobs: list[tuple[str | None, list[int], int]]) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Every (adapter, prompt, tokens) job at once, to completion: each one's greedy tokens and first logits."""
    recorder = FirstLogits(engine)
    requests = [
        engine.add_request(
            f"j{i}", prompt, SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True), adapter_id=a
        )
        for i, (a, prompt, n) in enumerate(jobs)
    ]
    while engine.has_unfinished_requests():
        engine.step()
    return [r.output_token_ids for r in requests], [recorder.first[r.request_id] for r in requests]


@functools.cache
def peft_reference(base: Path, adapter: Path | None, prompt: tuple[int, ...], n: int) -> tuple[list[int], torch.Tensor]:
    """PEFT + HF greedy decoding of `n` tokens (EOS disabled): the tokens, and the raw logits of the first."""
    model = load_peft_model(base, adapter)
    config = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            generation_config=config,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(prompt) :].tolist(), out.logits[0][0].float()


def assert_matches_peft(
    base: Path, root: Path, jobs: list[tuple[str | None, list[int], int]], tokens: list[list[int]], logits: list[Any]
) -> None:
    for (name, prompt, n), ours, first in zip(jobs, tokens, logits, strict=True):
        want_tokens, want = peft_reference(base, None if name is None else root / name, tuple(prompt), n)
        torch.testing.assert_close(first, want, rtol=0, atol=2e-4 * want.abs().max().item(), msg=str(name))
        assert ours == want_tokens, name


def engine_for(model: str | Path, root: Path, **options: Any) -> LLMEngine:
    return LLMEngine(EngineConfig(dtype="float32", model=str(model), adapter_dir=str(root), **options))


ROUTES = ["cpp", "torch", "triton"] if Machine.probe("cpu").cpu_ops else ["torch", "triton"]


@pytest.mark.parametrize("route", ROUTES)
def test_untied_vocab_loras_match_peft_in_a_mixed_batch(
    route: str, tiny_model_dir: Path, untied: Path, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Embedding, head, both with layer LoRAs, plain LoRA and base rows in one batch. The Triton route (under its
    interpreter) also replays decode steps from graphs (engine/worker/cuda_graphs.py through EagerGraph): a step
    with an embedding-LoRA row runs eagerly, the head's LoRA is added after the replay."""
    monkeypatch.setenv("LORAGATE_LORA_BACKEND", route)
    n = 3 if route == "triton" else TOKENS
    jobs = [(name, prompts[i % 2], n) for i, name in enumerate([None, *ADAPTERS])]
    if route == "triton":
        monkeypatch.setenv("LORAGATE_ATTENTION_BACKEND", "triton")
        # the first decode step has an embedding-LoRA row (mixed) and runs eagerly, the last one replays a graph
        jobs[1], jobs[3] = ("embed", prompts[1], 1), ("mixed", prompts[1], 2)
    engine = engine_for("tiny-random", untied, max_model_len=256, max_num_seqs=8)
    assert engine.runner.lora is not None and engine.runner.lora.kernel.value == route
    if route == "triton":
        engine.enable_graphs(EagerGraph, rank_floor=4)
    tokens, logits = run(engine, jobs)
    assert_matches_peft(tiny_model_dir, untied, jobs, tokens, logits)
    if route == "triton":
        assert engine.runner.graphs is not None and engine.runner.graphs.captures >= 1
    else:  # the vocabulary LoRAs change the output
        base = peft_reference(tiny_model_dir, None, tuple(prompts[0]), TOKENS)[0]
        for name in ("embed", "head"):
            assert peft_reference(tiny_model_dir, untied / name, tuple(prompts[0]), TOKENS)[0] != base, name
    spec = engine.adapters.get("mixed")
    assert spec.vocab_modules == ("embed_tokens", "lm_head") and spec.vocab_targets["lm_head"].rank == 6
    assert engine.device_adapters.vocab.active == len(ADAPTERS) - 1 and engine.device_adapters.vocab.nbytes > 0
    engine.device_adapters.retire("embed")  # evicting an adapter drops its vocabulary weights
    assert engine.device_adapters.vocab.active == len(ADAPTERS) - 2


@pytest.fixture(scope="module")
def tied_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_random(tmp_path_factory.mktemp("tied-base"), seed=3, tie_word_embeddings=True)


def test_tied_base_matches_peft(tied_base: Path, tmp_path: Path, prompts: list[list[int]]) -> None:
    """On a base with tied embeddings PEFT keeps a LoRA on embed_tokens to the input embeddings and one on lm_head to
    the logits; with ensure_weight_tying it targets the embedding and ties the head's LoRA to it (transposed, with the
    head's own scale: here from alpha_pattern)."""
    specs = {
        "embed": dict(r=4, alpha=8, targets=["embed_tokens"]),
        "head": dict(r=4, alpha=8, targets=["lm_head", "v_proj"]),
        "tied": dict(r=4, alpha=8, targets=["lm_head"], ensure_weight_tying=True, alpha_pattern={"lm_head": 2}),
    }
    root = _adapters(tied_base, tmp_path, specs)
    engine = engine_for(tied_base, root)
    spec = engine.adapters.get("tied")
    assert spec.vocab_modules == ("embed_tokens", "lm_head") and spec.tied_head
    assert spec.vocab_targets["lm_head"].scale == 0.5 and spec.vocab_targets["embed_tokens"].scale == 2.0
    assert not engine.adapters.get("embed").tied_head
    jobs = [(name, prompts[i % 2], TOKENS) for i, name in enumerate([None, *specs])]
    assert_matches_peft(tied_base, root, jobs, *run(engine, jobs))


def test_gemma_scales_the_embedding_delta_as_peft_does(tmp_path: Path, prompts: list[list[int]]) -> None:
    """Gemma 3 multiplies its embeddings by sqrt(hidden), and PEFT the embedding LoRA's delta too."""
    base = build_family("gemma3", tmp_path / "gemma3")
    root = _adapters(base, tmp_path / "adapters", {"embed": dict(r=4, alpha=8, targets=["embed_tokens", "lm_head"])})
    jobs = [("embed", prompts[0], 4), (None, prompts[1], 4)]
    assert_matches_peft(base, root, jobs, *run(engine_for(base, root), jobs))


def test_prompt_logprobs_get_the_head_lora(tiny_model_dir: Path, untied: Path, prompts: list[list[int]]) -> None:
    """Every prompt row's logits get its request's head LoRA, in pieces of rows (engine/worker/prompt_logprobs.py),
    beside a request of the base and one of another head LoRA."""
    engine = engine_for("tiny-random", untied, max_batch_tokens=16, max_prefill_tokens=8)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
    names = ["head", None, "mixed"]
    requests = [engine.add_request(f"p{i}", prompts[1], params, adapter_id=a) for i, a in enumerate(names)]
    while engine.has_unfinished_requests():
        engine.step()
    for name, request in zip(names, requests, strict=True):
        want = torch.log_softmax(peft_logits(tiny_model_dir, name and untied / name, prompts[1]), dim=-1)
        for p, entry in enumerate(request.prompt_logprobs[1:], start=1):
            assert entry is not None and abs(entry.logprob - want[p - 1, prompts[1][p]].item()) <= 3e-4, (name, p)
            assert [v for _, v in entry.top] == pytest.approx(want[p - 1].topk(2).values.tolist(), abs=3e-4)


RULES = [  # (base, LoraConfig arguments, whether the head's LoRA is tied to the embedding's)
    ("untied", dict(targets=["embed_tokens", "q_proj"], layers_to_transform=[1]), False),  # no layer index: left out
    ("untied", dict(targets=["lm_head", "q_proj"], layers_to_transform=[1]), False),  # an exact name: kept
    ("untied", dict(targets=["model.embed_tokens", "q_proj"], layers_to_transform=[1]), False),
    ("untied", dict(targets=r".*(embed_tokens|q_proj)"), False),
    ("untied", dict(targets="all-linear"), False),  # neither
    ("untied", dict(targets=["embed_tokens", "lm_head"], exclude_modules=["lm_head"]), False),
    ("untied", dict(targets=["embed_tokens"], ensure_weight_tying=True), False),  # nothing to tie
    ("tied", dict(targets="lm_head", ensure_weight_tying=True), True),
    ("tied", dict(targets=r"model\.embed_tokens", ensure_weight_tying=True), False),  # PEFT tests the bare name
]


def test_the_modules_adapted_are_peft_s(tiny_model_dir: Path, tied_base: Path, tmp_path: Path) -> None:
    """The modules an adapter adapts are the ones PEFT wraps when it loads the same files (layers_to_transform,
    regexes, all-linear, exclude_modules and ensure_weight_tying on embed_tokens and lm_head)."""
    bases = {"untied": tiny_model_dir, "tied": tied_base}
    engines = {name: LLMEngine(EngineConfig(dtype="float32", model=str(base))) for name, base in bases.items()}
    for i, (base, kwargs, tied) in enumerate(RULES):
        adapter = make_peft_adapter(bases[base], tmp_path / str(i), r=4, alpha=8, seed=i, **kwargs)
        spec = engines[base].adapters.register(str(i), adapter, engines[base].verify_adapter)
        layers = {module_name(layer, module) for layer, module, _ in spec.targets()}
        ours = layers | {VOCAB_MODULES[module] for module in spec.vocab_modules}
        assert ours == set(load_peft_model(bases[base], adapter).base_model.targeted_module_names), kwargs
        assert spec.tied_head == tied, kwargs


def test_what_peft_cannot_serve_either_is_refused(tied_base: Path, tmp_path: Path) -> None:
    """DoRA on the embedding, and ensure_weight_tying with the embedding excluded (PEFT fails to build it)."""
    model = load_model_config(tied_base)
    raw = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["embed_tokens", "q_proj"]}
    with pytest.raises(AdapterError, match="DoRA on embed_tokens is not supported"):
        plan_vocab("d", parse_config("d", {**raw, "use_dora": True}), model)
    tied = {**raw, "ensure_weight_tying": True, "exclude_modules": ["embed_tokens"]}
    with pytest.raises(AdapterError, match="ensure_weight_tying ties lm_head's LoRA to embed_tokens', which exclude"):
        plan_vocab("t", parse_config("t", tied), model)
    config = LoraConfig(target_modules=["embed_tokens"], ensure_weight_tying=True, exclude_modules=["embed_tokens"])
    with pytest.raises(AttributeError):
        get_peft_model(hf_base_model(tied_base), config)


def _rewrite(source: Path, dest: Path, change: Any) -> Path:
    """A copy of an adapter whose tensors `change(dict)` edits in place."""
    shutil.copytree(source, dest)
    tensors = load_file(str(dest / "adapter_model.safetensors"))
    change(tensors)
    save_file(tensors, str(dest / "adapter_model.safetensors"), metadata={"format": "pt"})
    return dest


def _altered_row(tensors: dict[str, torch.Tensor]) -> None:
    tensors[COPY_KEY][17] += 0.25


def _resized(tensors: dict[str, torch.Tensor]) -> None:
    copy = tensors[COPY_KEY]
    tensors[COPY_KEY] = torch.cat([copy, copy[:2]])


def _wide_a(tensors: dict[str, torch.Tensor]) -> None:
    a = tensors[f"{EMBED_KEY}_A"]
    tensors[f"{EMBED_KEY}_A"] = torch.cat([a, a[:, :5]], dim=1)


def _nan_b(tensors: dict[str, torch.Tensor]) -> None:
    tensors[f"{EMBED_KEY}_B"][3, 1] = float("nan")


def _untied_head(tensors: dict[str, torch.Tensor]) -> None:
    tensors["base_model.model.lm_head.lora_B.weight"][0, 0] += 1.0


BROKEN = {  # name -> (how the embed adapter's file is changed, what the refusal says)
    "row": (_altered_row, ["own embed_tokens weights", "differ from the base model's", "rows 0..255"]),
    "resized": (_resized, ["own embed_tokens weights", "resized vocabulary", "[470, 64]"]),
    "wide": (_wide_a, [f"{EMBED_KEY}_A", "[4, 473]", "resized vocabulary"]),
    "nan": (_nan_b, ["lora_embedding_B of model.embed_tokens", "non-finite"]),
}


def test_broken_vocabulary_files_are_refused_beside_a_running_batch(
    tiny_model_dir: Path, untied: Path, prompts: list[list[int]], tmp_path: Path
) -> None:
    """Copies of the base's embeddings equal to it are served (PEFT saved them with every adapter here); one altered
    row, a resized vocabulary, an embedding A wider than the vocabulary and a NaN in lora_embedding_B are refused by
    the engine's load path with a message naming the problem, while a batch runs beside them unharmed."""
    assert COPY_KEY in load_file(str(untied / "embed" / "adapter_model.safetensors"))
    engine = engine_for("tiny-random", untied)
    jobs = [("mixed", prompts[0], TOKENS), ("head", prompts[1], TOKENS), (None, prompts[1], TOKENS)]
    params = SamplingParams(max_tokens=TOKENS, min_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    requests = [engine.add_request(f"b{i}", p, params, adapter_id=a) for i, (a, p, _) in enumerate(jobs)]
    engine.step()
    for name, (change, needles) in BROKEN.items():
        _rewrite(untied / "embed", tmp_path / name, change)
        with pytest.raises(AdapterError) as refused:
            engine.adapters.register(name, tmp_path / name, engine.verify_adapter)
        assert all(needle in str(refused.value) for needle in needles), str(refused.value)
        engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    for (name, prompt, n), request in zip(jobs, requests, strict=True):
        assert request.output_token_ids == peft_reference(tiny_model_dir, name and untied / name, tuple(prompt), n)[0]


def test_a_tied_head_must_be_the_embeddings_transposed(tied_base: Path, tmp_path: Path) -> None:
    make_peft_adapter(
        tied_base,
        tmp_path / "tied",
        r=4,
        alpha=8,
        targets=["embed_tokens"],
        seed=2,
        b_std=0.3,
        ensure_weight_tying=True,
    )
    _rewrite(tmp_path / "tied", tmp_path / "untied-head", _untied_head)
    engine = LLMEngine(EngineConfig(dtype="float32", model=str(tied_base)))
    engine.adapters.register("tied", tmp_path / "tied", engine.verify_adapter)
    with pytest.raises(AdapterError, match="lm_head.lora_B.weight is not the transpose of embed_tokens"):
        engine.adapters.register("bad", tmp_path / "untied-head", engine.verify_adapter)


@pytest.fixture(scope="module")
def server_root(tiny_model_dir: Path, untied: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """head is served from the start; incoming/ holds what is POSTed."""
    root = tmp_path_factory.mktemp("served")
    shutil.copytree(untied / "head", root / "head")
    incoming = root / "incoming"
    make_peft_adapter(
        tiny_model_dir, incoming / "saves", r=4, alpha=8, targets=["q_proj"], seed=5, modules_to_save=["lm_head"]
    )
    make_peft_adapter(
        tiny_model_dir, incoming / "tokens", r=4, alpha=8, targets=["q_proj"], seed=6, trainable_token_indices=[5, 9]
    )
    _rewrite(untied / "embed", incoming / "row", _altered_row)
    _rewrite(untied / "embed", incoming / "resized", _resized)
    shutil.copytree(untied / "embed", incoming / "embed")
    return root


@pytest.fixture(scope="module")
def server(server_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc, base = start_engine_server(
        tmp_path_factory.mktemp("engine") / "engine.log", "--max-model-len", "256", "--adapter-dir", str(server_root)
    )
    yield base
    proc.terminate()
    proc.wait(timeout=60)


@pytest.mark.parametrize(
    ("name", "needles"),
    [
        ("saves", ["modules_to_save=", "a full copy of the listed modules' weights per adapter"]),
        ("tokens", ["trainable_token_indices=", "a trained copy of embedding rows per adapter"]),
        ("row", ["own embed_tokens weights", "rows 0..255"]),
        ("resized", ["own embed_tokens weights", "resized vocabulary"]),
    ],
)
def test_refusals_over_http_are_400_naming_the_reason(server: str, name: str, needles: list[str]) -> None:
    resp = httpx.post(f"{server}/v1/adapters", json={"id": name, "path": f"incoming/{name}"}, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and all(n in error["message"] for n in needles), error


def test_a_vocabulary_lora_is_served_over_http(
    server: str, server_root: Path, tiny_model_dir: Path, prompts: list[list[int]]
) -> None:
    resp = httpx.post(f"{server}/v1/adapters", json={"id": "embed", "path": "incoming/embed"}, timeout=60)
    assert resp.status_code == 200, resp.text
    # the card says what it adapts, as PEFT's own config names it
    config = json.loads((server_root / "incoming/embed/adapter_config.json").read_text())
    card = resp.json()
    assert card["kind"] == "LoRA" and "embed_tokens" in card["target_modules"]
    assert set(card["target_modules"]) == {m.split(".")[-1] for m in config["target_modules"]}
    for name in ("embed", "head"):
        body = {"prompt": prompts[0], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        answer = httpx.post(f"{server}/v1/completions", json=body, headers={"X-Adapter-ID": name}, timeout=60)
        assert answer.status_code == 200, answer.text
        text = answer.json()["choices"][0]["text"]
        expected = peft_greedy(
            tiny_model_dir, server_root / ("incoming/embed" if name == "embed" else name), prompts[0], 4
        )
        assert text == load_tokenizer(tiny_model_dir).decode(expected)


def test_smollm2_matches_peft(smollm2_dir: Path, tmp_path: Path) -> None:
    """Once on SmolLM2 (tied embeddings, the C++ route where it builds): an embedding and head LoRA with layer LoRAs."""
    root = _adapters(
        smollm2_dir, tmp_path, {"vocab": dict(r=8, alpha=16, targets=["embed_tokens", "lm_head", "q_proj", "v_proj"])}
    )
    prompt = [1, 4093, 2156, 314, 253, 3465, 30]
    jobs = [("vocab", prompt, 3), (None, prompt, 3)]
    engine = engine_for(smollm2_dir, root, max_model_len=128)
    assert_matches_peft(smollm2_dir, root, jobs, *run(engine, jobs))
