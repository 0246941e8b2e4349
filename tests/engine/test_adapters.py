"""engine/lora/peft_config.py, files.py and registry.py against real PEFT adapters: parsing (ranks,
scales, patterns), rejections, registry, host cache."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import shutil
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import engine.lora.files as adapter_files
import engine.lora.registry as adapters
from engine.lora.files import load_weights, read_adapter
from engine.lora.peft_config import MODULES, AdapterError, validate_adapter_id
from engine.lora.registry import AdapterRegistry
from engine.model.config import ModelConfig, load_model_config

from lora_fixtures import load_peft_model, make_peft_adapter, peft_greedy

# (r, alpha, targets, extra LoraConfig fields): every target form, rslora, patterns, layer selection.
PARSE_CASES = {
    "r2-list": (2, 4.0, ["q_proj", "v_proj"], {}),
    "r4-all-linear": (4, 8.0, "all-linear", {}),
    "r8-regex": (8, 16.0, r".*\.layers\.[13]\.(self_attn\.(k|o)_proj|mlp\.up_proj)", {}),
    "r16-rslora": (16, 8.0, ["gate_proj", "up_proj", "down_proj"], {"use_rslora": True}),
    "r32-suffixes": (32, 64.0, ["self_attn.q_proj", "o_proj", "model.layers.2.mlp.down_proj"], {}),
    "r4-patterns": (
        4,
        8.0,
        ["q_proj", "v_proj", "down_proj"],
        {
            # Keys sort (PEFT saves sorted) in the order they are written, so training and loading agree.
            "rank_pattern": {"layers.0.self_attn.q_proj": 8, r"layers\.[23]\.mlp\.down_proj": 16, "q_proj": 2},
            "alpha_pattern": {"model.layers.1.mlp.down_proj": 5.0, "v_proj": 3.0},
        },
    ),
    "r4-layers-exclude": (
        4,
        4.0,
        ["q_proj", "k_proj"],
        {
            "layers_to_transform": [0, 2],
            "exclude_modules": ["model.layers.2.self_attn.k_proj"],
        },
    ),
}


@pytest.fixture(scope="module")
def model_config(tiny_model_dir: Path) -> ModelConfig:
    return load_model_config(tiny_model_dir)


@pytest.fixture(scope="module")
def good_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A q/v rank-4 adapter; tests copy it before breaking it."""
    out = tmp_path_factory.mktemp("good") / "qv"
    return make_peft_adapter(tiny_model_dir, out, r=4, alpha=8, targets=["q_proj", "v_proj"], seed=7)


@pytest.fixture
def broken(good_dir: Path, tmp_path: Path) -> Path:
    """A fresh copy of good_dir to break."""
    return Path(shutil.copytree(good_dir, tmp_path / "broken"))


def _edit_config(adapter_dir: Path, **fields: object) -> None:
    path = adapter_dir / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def _edit_tensors(adapter_dir: Path, edit) -> None:
    path = adapter_dir / "adapter_model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _peft_linear(peft_model: torch.nn.Module, layer: int, module: str) -> torch.nn.Module:
    block = peft_model.base_model.model.model.layers[layer]
    owner = block.self_attn if module in ("q_proj", "k_proj", "v_proj", "o_proj") else block.mlp
    return getattr(owner, module)


# ---- parsing matches PEFT ------------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(PARSE_CASES))
def test_delta_matches_peft(case: str, tiny_model_dir: Path, model_config: ModelConfig, tmp_path: Path) -> None:
    r, alpha, targets, extra = PARSE_CASES[case]
    adapter_dir = make_peft_adapter(
        tiny_model_dir, tmp_path / case, r=r, alpha=alpha, targets=targets, seed=r, b_std=0.5, **extra
    )
    spec = read_adapter(adapter_dir, case, 1, model_config)
    weights = load_weights(spec, model_config, torch.float32)
    peft_model = load_peft_model(tiny_model_dir, adapter_dir)  # PEFT's own reading of the saved files
    gen = torch.Generator().manual_seed(0)
    adapted = set()
    for layer in range(model_config.num_layers):
        for module in MODULES:
            peft_layer = _peft_linear(peft_model, layer, module)
            if "default" not in getattr(peft_layer, "r", {}):
                assert module not in spec.layers[layer]
                continue
            adapted.add((layer, module))
            target = spec.layers[layer][module]
            assert target.rank == peft_layer.r["default"]
            assert target.scale == pytest.approx(peft_layer.scaling["default"], rel=1e-12)
            x = torch.randn(5, peft_layer.in_features, generator=gen)
            with torch.no_grad():
                expected = peft_layer(x) - peft_layer.base_layer(x)
            a, b_scaled = weights.layers[layer][module]
            torch.testing.assert_close((x @ a.T) @ b_scaled.T, expected, rtol=1e-4, atol=1e-5)
    assert adapted == {(layer, module) for layer, module, _ in spec.targets()}
    assert spec.max_rank == max(t.rank for _, _, t in spec.targets())


def test_all_linear_and_patterns_resolve_as_documented(
    tmp_path: Path, tiny_model_dir: Path, model_config: ModelConfig
) -> None:
    r, alpha, targets, extra = PARSE_CASES["r4-patterns"]
    adapter_dir = make_peft_adapter(tiny_model_dir, tmp_path / "p", r=r, alpha=alpha, targets=targets, seed=1, **extra)
    spec = read_adapter(adapter_dir, "p", 1, model_config)
    ranks = [{m: t.rank for m, t in layer.items()} for layer in spec.layers]
    assert ranks == [
        {"q_proj": 8, "v_proj": 4, "down_proj": 4},
        {"q_proj": 2, "v_proj": 4, "down_proj": 4},
        {"q_proj": 2, "v_proj": 4, "down_proj": 16},
        {"q_proj": 2, "v_proj": 4, "down_proj": 16},
    ]
    assert spec.layers[1]["down_proj"].scale == 5.0 / 4 and spec.layers[0]["v_proj"].scale == 3.0 / 4
    assert spec.modules == ("q_proj", "v_proj", "down_proj") and spec.max_rank == 16
    all_linear_dir = make_peft_adapter(tiny_model_dir, tmp_path / "a", r=4, alpha=8, targets="all-linear", seed=2)
    all_linear = read_adapter(all_linear_dir, "a", 1, model_config)
    assert all_linear.modules == MODULES


def test_spec_sizes_and_dtype(good_dir: Path, model_config: ModelConfig) -> None:
    spec = read_adapter(good_dir, "qv", 3, model_config)
    hidden, kv_out = model_config.hidden_size, model_config.num_kv_heads * model_config.head_dim
    per_layer = 4 * (hidden + model_config.num_heads * model_config.head_dim) + 4 * (hidden + kv_out)
    assert spec.num_params == model_config.num_layers * per_layer and spec.nbytes == 4 * spec.num_params
    assert (spec.adapter_id, spec.version, spec.path, spec.max_rank) == ("qv", 3, good_dir.resolve(), 4)
    fp32 = load_weights(spec, model_config, torch.float32)
    bf16 = load_weights(spec, model_config, torch.bfloat16)
    assert fp32.nbytes == spec.nbytes and bf16.nbytes == spec.nbytes // 2
    for (_a32, b32), (a16, b16) in zip(fp32.layers[0].values(), bf16.layers[0].values(), strict=True):
        assert a16.dtype == b16.dtype == torch.bfloat16 and a16.is_contiguous() and b16.t().is_contiguous()
        torch.testing.assert_close(b16.float(), b32, rtol=1e-2, atol=1e-3)
    assert fp32.layers[0]["q_proj"][0].shape == (4, hidden)
    assert fp32.layers[0]["v_proj"][1].shape == (kv_out, 4)


def test_register_reads_only_the_header(
    good_dir: Path, model_config: ModelConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_safe_open = adapter_files.safe_open

    class HeaderOnly:
        def __init__(self, *args: object, **kwargs: object) -> None:
            self._inner = real_safe_open(*args, **kwargs)

        def __enter__(self) -> HeaderOnly:
            self._inner.__enter__()
            return self

        def __exit__(self, *exc: object) -> None:
            self._inner.__exit__(*exc)

        def keys(self) -> list[str]:
            return self._inner.keys()

        def get_slice(self, key: str) -> object:
            return self._inner.get_slice(key)

        def get_tensor(self, key: str) -> torch.Tensor:
            raise AssertionError(f"registration read tensor data ({key})")

    monkeypatch.setattr(adapter_files, "safe_open", HeaderOnly)
    assert AdapterRegistry(model_config).register("qv", good_dir).version == 1


# ---- rejections ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad_id",
    [
        *("../x", "a/b/c", "/a", "a/", "a/../b", ".ns/a", "a\\b", "..", ".hidden", "x" * 10_000, "", "a\x00b"),
        *("a..b", "a b", "é", "a\n", "a@", "@1", "a@x", "a@1@2", "a@١", 7, None),
    ],
)
def test_hostile_ids_rejected(bad_id: object, model_config: ModelConfig, good_dir: Path) -> None:
    with pytest.raises(AdapterError, match="adapter id"):
        validate_adapter_id(bad_id)  # type: ignore[arg-type]
    with pytest.raises(AdapterError, match="adapter id"):
        AdapterRegistry(model_config).register(bad_id, good_dir)  # type: ignore[arg-type]


def test_good_ids_accepted() -> None:
    for good in ("a", "my-adapter_v1.2", "A" * 128, "x.y", "acme/support", "acme/support@12", "support@3"):
        assert validate_adapter_id(good) == good


def _rejects(path: Path | str, model_config: ModelConfig, *needles: str, adapter_id: str = "bad") -> None:
    with pytest.raises(AdapterError) as info:
        read_adapter(path, adapter_id, 1, model_config)  # type: ignore[arg-type]
    message = str(info.value)
    assert repr(adapter_id) in message
    for needle in needles:
        assert needle in message, message


def test_directory_problems(broken: Path, tmp_path: Path, model_config: ModelConfig) -> None:
    _rejects(tmp_path / "nope", model_config, "does not exist")
    _rejects(broken / "adapter_config.json", model_config, "is not a directory")
    _rejects("/tmp/a\x00b", model_config, "unusable path")
    (broken / "adapter_model.safetensors").unlink()
    _rejects(broken, model_config, "no adapter_model.safetensors")
    (broken / "adapter_config.json").unlink()
    _rejects(broken, model_config, "no adapter_config.json")


def test_pickle_only_dir_is_never_unpickled(
    broken: Path, model_config: ModelConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.save(load_file(broken / "adapter_model.safetensors"), broken / "adapter_model.bin")
    (broken / "adapter_model.safetensors").unlink()

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("something tried to unpickle")

    for owner, name in (
        (torch, "load"),
        (torch.serialization, "load"),
        (pickle, "load"),
        (pickle, "loads"),
        (pickle, "Unpickler"),
    ):
        monkeypatch.setattr(owner, name, refuse)
    _rejects(broken, model_config, "adapter_model.bin", "pickle files are never loaded")
    with pytest.raises(AdapterError, match="pickle files are never loaded"):
        AdapterRegistry(model_config).register("bad", broken)


def test_symlinks(broken: Path, tmp_path: Path, model_config: ModelConfig) -> None:
    outside = tmp_path / "elsewhere.safetensors"
    (broken / "adapter_model.safetensors").rename(outside)
    (broken / "adapter_model.safetensors").symlink_to(outside)
    _rejects(broken, model_config, "symlink pointing outside the adapter directory")
    (broken / "adapter_model.safetensors").unlink()
    shutil.move(outside, broken / "real.safetensors")
    (broken / "adapter_model.safetensors").symlink_to("real.safetensors")  # inside: fine
    (tmp_path / "linked").symlink_to(broken, target_is_directory=True)  # a linked directory: resolved
    assert read_adapter(tmp_path / "linked", "ok", 1, model_config).path == broken.resolve()
    (broken / "adapter_config.json").rename(tmp_path / "cfg.json")
    (broken / "adapter_config.json").symlink_to(tmp_path / "cfg.json")
    _rejects(broken, model_config, "adapter_config.json is a symlink pointing outside")


@pytest.mark.parametrize(
    ("fields", "needles"),
    [
        ({"peft_type": "IA3"}, ("peft_type is 'IA3'", "only LoRA")),
        ({"use_dora": True}, ("lacks base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector",)),
        ({"bias": "all"}, ("bias='all'",)),
        ({"modules_to_save": ["lm_head"]}, ("modules_to_save",)),
        ({"target_modules": ["q_proj", "lm_head"]}, ("lacks base_model.model.lm_head.lora_A.weight", "lm_head")),
        ({"target_modules": ["embed_tokens"]}, ("lacks base_model.model.model.embed_tokens.lora_embedding_A",)),
        ({"target_modules": ["q_proj", "norm"]}, ("'norm'", "only to q_proj")),
        ({"r": 0}, ("r=0", "positive integer")),
        ({"rank_pattern": {"q_proj": 0}}, ("rank_pattern['q_proj']=0",)),
        ({"lora_alpha": "big"}, ("lora_alpha='big'",)),
        ({"target_modules": "(unclosed"}, ("not a valid regex",)),
        ({"target_modules": r".*\.lm_head"}, ("targets no module",)),
        ({"init_lora_weights": "pissa"}, ("rewrites the base weights",)),
        ({"layer_replication": [[0, 2], [1, 4]]}, ("layer replication",)),
        ({"target_modules": ["q_proj"]}, ("has weights for model.layers.0.self_attn.v_proj", "does not target")),
    ],
)
def test_config_rejections(fields: dict, needles: tuple[str, ...], broken: Path, model_config: ModelConfig) -> None:
    _edit_config(broken, **fields)
    _rejects(broken, model_config, *needles)


def test_unreadable_config(broken: Path, model_config: ModelConfig) -> None:
    (broken / "adapter_config.json").write_text("{not json")
    _rejects(broken, model_config, "not valid JSON")
    (broken / "adapter_config.json").write_text("[1, 2]")
    _rejects(broken, model_config, "not a JSON object")


def test_base_model_path_mismatch_is_fine(broken: Path, model_config: ModelConfig) -> None:
    _edit_config(broken, base_model_name_or_path="/some/other/machine/model")
    assert read_adapter(broken, "ok", 1, model_config).max_rank == 4


def test_tensor_rejections(broken: Path, model_config: ModelConfig) -> None:
    key = "base_model.model.model.layers.{}.self_attn.{}.lora_{}.weight"
    _edit_tensors(broken, lambda t: t.update({"base_model.model.model.norm.lora_A.weight": torch.zeros(4, 64)}))
    _rejects(broken, model_config, "1 tensor(s)", "base_model.model.model.norm.lora_A.weight")
    _edit_tensors(broken, lambda t: t.pop("base_model.model.model.norm.lora_A.weight"))
    _edit_tensors(broken, lambda t: t.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}))
    _rejects(broken, model_config, "has weights for lm_head", "does not target")
    _edit_tensors(broken, lambda t: t.pop("base_model.model.lm_head.lora_A.weight"))
    _edit_tensors(broken, lambda t: t.pop(key.format(2, "v_proj", "B")))
    _rejects(broken, model_config, f"lacks {key.format(2, 'v_proj', 'B')}")
    int_b = torch.zeros(32, 4, dtype=torch.int32)
    _edit_tensors(broken, lambda t: t.update({key.format(2, "v_proj", "B"): int_b}))
    _rejects(broken, model_config, "dtype I32")
    _edit_tensors(broken, lambda t: t.update({key.format(2, "v_proj", "B"): torch.zeros(32, 5)}))
    _rejects(broken, model_config, f"{key.format(2, 'v_proj', 'B')} has shape [32, 5], expected [32, 4]")


def test_other_base_model_rejected(good_dir: Path, model_config: ModelConfig) -> None:
    wider = dataclasses.replace(model_config, hidden_size=128)
    _rejects(
        good_dir,
        wider,
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight has shape [4, 64], expected [4, 128]",
        "another model",
    )
    _rejects(good_dir, dataclasses.replace(model_config, num_layers=2), "layers.2.self_attn")


def test_peft_sorted_pattern_quirk_rejected(tiny_model_dir: Path, tmp_path: Path, model_config: ModelConfig) -> None:
    """PEFT trains with pattern keys in dict order but saves them sorted: here the saved config disagrees
    with the saved tensors (layer 0 q_proj trained at rank 2, loads at rank 8). PEFT cannot load it either."""
    adapter_dir = make_peft_adapter(
        tiny_model_dir,
        tmp_path / "q",
        r=4,
        alpha=8,
        targets=["q_proj"],
        seed=3,
        rank_pattern={"q_proj": 2, "layers.0.self_attn.q_proj": 8},
    )
    with pytest.raises(RuntimeError, match="size mismatch"):
        load_peft_model(tiny_model_dir, adapter_dir)
    _rejects(
        adapter_dir,
        model_config,
        "layers.0.self_attn.q_proj.lora_A.weight has shape [2, 64], expected [8, 64]",
        adapter_id="q",
    )


@pytest.mark.parametrize("blob", [b"", b"\x00" * 7 + b"garbage" * 20, b"truncate"])
def test_corrupt_safetensors(blob: bytes, broken: Path, model_config: ModelConfig) -> None:
    path = broken / "adapter_model.safetensors"
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2] if blob == b"truncate" else blob)
    _rejects(broken, model_config, "not a valid safetensors file")


def test_non_finite_weights_rejected_at_load(broken: Path, model_config: ModelConfig) -> None:
    key = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"
    _edit_tensors(broken, lambda t: t[key].__setitem__((0, 0), float("nan")))
    spec = read_adapter(broken, "nan", 1, model_config)  # the header cannot tell
    with pytest.raises(AdapterError, match=r"'nan': lora_A of model.layers.1.self_attn.q_proj has non-fin"):
        load_weights(spec, model_config, torch.float32)


def test_fp16_overflow_rejected(broken: Path, model_config: ModelConfig) -> None:
    key = "base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"
    _edit_tensors(broken, lambda t: t[key].fill_(1e5))  # * scale 2 = 2e5 > fp16 max
    spec = read_adapter(broken, "big", 1, model_config)
    assert load_weights(spec, model_config, torch.float32).layers[0]["v_proj"][1].max() == 2e5
    with pytest.raises(AdapterError, match="non-finite values .* in torch.float16"):
        load_weights(spec, model_config, torch.float16)


# ---- registry --------------------------------------------------------------------------------------------


def test_registry_versions_and_unregister(good_dir: Path, model_config: ModelConfig) -> None:
    registry = AdapterRegistry(model_config)
    assert registry.register("b", good_dir).version == 1
    assert registry.register("a", good_dir).version == 1
    assert registry.register("b", good_dir).version == 2
    assert registry.get("b").version == 2
    assert [(s.adapter_id, s.version) for s in registry.list()] == [("a", 1), ("b", 2)]
    assert registry.unregister("b").version == 2
    with pytest.raises(KeyError):
        registry.get("b")
    with pytest.raises(KeyError):
        registry.unregister("b")
    assert registry.register("b", good_dir).version == 3  # never reuses a version after unregister
    with pytest.raises(AdapterError, match="does not exist"):
        registry.register("c", good_dir / "missing")
    assert [s.adapter_id for s in registry.list()] == ["a", "b"]


def test_registry_concurrent_registers(good_dir: Path, model_config: ModelConfig) -> None:
    registry = AdapterRegistry(model_config)
    versions: list[int] = []

    def work() -> None:
        for _ in range(3):
            versions.append(registry.register("same", good_dir).version)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(versions) == list(range(1, 13)) and registry.get("same").version == 12


def test_scan_dir(good_dir: Path, tmp_path: Path, model_config: ModelConfig, caplog: pytest.LogCaptureFixture) -> None:
    for name in ("alpha", "beta", "corrupt", ".hidden", "has space"):
        shutil.copytree(good_dir, tmp_path / name)
    (tmp_path / "corrupt" / "adapter_model.safetensors").write_bytes(b"\x01\x02")
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("not an adapter")
    registry = AdapterRegistry(model_config)
    with caplog.at_level(logging.WARNING, logger="engine.lora.registry"):
        specs = registry.scan_dir(tmp_path)
    assert [s.adapter_id for s in specs] == ["alpha", "beta"] == [s.adapter_id for s in registry.list()]
    warnings = "\n".join(r.getMessage() for r in caplog.records)
    for needle in ("'corrupt'", "not a valid safetensors", "'.hidden'", "'has space'", "'empty'"):
        assert needle in warnings
    with pytest.raises(AdapterError, match="not a directory"):
        registry.scan_dir(tmp_path / "notes.txt")


# ---- host cache ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def three_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Three same-size (rank-4 q/v) adapters with different weights."""
    root = tmp_path_factory.mktemp("cache")
    return [
        make_peft_adapter(tiny_model_dir, root / f"a{i}", r=4, alpha=8, targets=["q_proj", "v_proj"], seed=i)
        for i in range(3)
    ]


def _counters(cache: adapters.HostAdapterCache) -> tuple[int, int, int, int]:
    return cache.hits, cache.misses, cache.loads, cache.evictions


def test_cache_lru_and_byte_bound(three_dirs: list[Path], model_config: ModelConfig) -> None:
    registry = AdapterRegistry(model_config)
    a, b, c = (registry.register(f"a{i}", d) for i, d in enumerate(three_dirs))
    size = a.nbytes // 2  # bf16
    cache = adapters.HostAdapterCache(2 * size + size // 2, model_config, torch.bfloat16)
    first = cache.get(a)
    assert first.nbytes == size and _counters(cache) == (0, 1, 1, 0)
    assert cache.get(a) is first and _counters(cache) == (1, 1, 1, 0)
    cache.get(b)
    cache.get(a)  # a is now the most recent: c evicts b
    cache.get(c)
    assert (cache.contains(a), cache.contains(b), cache.contains(c)) == (True, False, True)
    assert _counters(cache) == (2, 3, 3, 1) and cache.used_bytes == 2 * size <= cache.capacity_bytes
    cache.prefetch(b)  # evicts a (least recent); prefetch is neither a hit nor a miss
    assert (cache.contains(a), cache.contains(b)) == (False, True) and _counters(cache) == (2, 3, 4, 2)
    cache.prefetch(b)
    assert cache.loads == 4
    cache.discard("a2")
    assert not cache.contains(c) and cache.used_bytes == size


def test_preload_fills_without_evicting_and_skips_broken(
    three_dirs: list[Path], tmp_path: Path, model_config: ModelConfig, caplog: pytest.LogCaptureFixture
) -> None:
    registry = AdapterRegistry(model_config)
    a, b, c = (registry.register(f"a{i}", d) for i, d in enumerate(three_dirs))
    broken = Path(shutil.copytree(three_dirs[2], tmp_path / "bad"))  # the same size as the others
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    _edit_tensors(broken, lambda t: t[key].fill_(float("nan")))
    bad = registry.register("bad", broken)  # registering reads the header only: found when its weights are read
    size = a.nbytes // 2  # bf16
    cache = adapters.HostAdapterCache(2 * size + size // 2, model_config, torch.bfloat16)
    cache.get(c)
    with caplog.at_level(logging.WARNING):
        assert cache.preload([bad, c, b, a]) == 1  # bad skipped, c already there, b fits, a then does not
    assert "not preloading adapter bad" in caplog.text
    assert (cache.contains(a), cache.contains(b), cache.contains(c), cache.contains(bad)) == (False, True, True, False)
    assert cache.evictions == 0 and cache.used_bytes == 2 * size
    assert _counters(cache) == (0, 1, 2, 0)  # a preload is neither a hit nor a miss
    assert cache.preload([]) == 0


def test_cache_oversized_adapter_returned_not_kept(
    three_dirs: list[Path], tiny_model_dir: Path, tmp_path: Path, model_config: ModelConfig
) -> None:
    big_dir = make_peft_adapter(tiny_model_dir, tmp_path / "big", r=16, alpha=16, targets="all-linear", seed=5)
    spec = read_adapter(big_dir, "big", 1, model_config)
    small = read_adapter(three_dirs[1], "small", 1, model_config)
    cache = adapters.HostAdapterCache(2 * small.nbytes, model_config, torch.float32)
    assert spec.nbytes > cache.capacity_bytes
    cache.get(small)
    weights = cache.get(spec)
    assert weights.nbytes == spec.nbytes and not cache.contains(spec)
    assert cache.contains(small) and cache.evictions == 0  # nothing evicted for an adapter that cannot fit


def test_cache_keyed_by_version(three_dirs: list[Path], tmp_path: Path, model_config: ModelConfig) -> None:
    live = Path(shutil.copytree(three_dirs[0], tmp_path / "live"))
    registry = AdapterRegistry(model_config)
    cache = adapters.HostAdapterCache(1 << 30, model_config, torch.float32)
    v1 = registry.register("x", live)
    old = cache.get(v1).layers[0]["q_proj"][0]
    shutil.copy(three_dirs[1] / "adapter_model.safetensors", live / "adapter_model.safetensors")
    stat = (live / "adapter_model.safetensors").stat()
    os.utime(live / "adapter_model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    v2 = registry.register("x", live)
    new = cache.get(v2).layers[0]["q_proj"][0]
    assert cache.misses == 2 and not torch.equal(old, new)
    expected = load_file(three_dirs[1] / "adapter_model.safetensors")
    assert torch.equal(new, expected["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"])
    assert cache.get(v1).layers[0]["q_proj"][0] is old  # still cached: in-flight requests may hold v1
    cache.discard("x")
    assert not cache.contains(v1) and not cache.contains(v2) and cache.used_bytes == 0
    with pytest.raises(AdapterError, match="changed on disk since version 1 was registered"):
        cache.get(v1)  # v1's file content is gone: never serve v2's bytes under v1's spec


def test_shared_adapters_change_greedy_output(
    tiny_model_dir: Path, tiny_adapters: dict[str, Path], tiny_model_config: ModelConfig
) -> None:
    """The conftest adapters are useful references: PEFT's greedy output differs per adapter."""
    prompt = [1, 5, 6, 7, 80, 90]
    outputs = {None: tuple(peft_greedy(tiny_model_dir, None, prompt, 6))}
    registry = AdapterRegistry(tiny_model_config)
    for adapter_id, adapter_dir in tiny_adapters.items():
        registry.register(adapter_id, adapter_dir)
        outputs[adapter_id] = tuple(peft_greedy(tiny_model_dir, adapter_dir, prompt, 6))
    assert all(len(out) == 6 for out in outputs.values())
    assert len(set(outputs.values())) == len(outputs)
    assert [s.adapter_id for s in registry.list()] == sorted(tiny_adapters)
