"""Every family the engine serves (engine/model/config.py) against transformers' own implementation of it: logits over
paged, mixed steps equal HF's on each route of the layer ops and attention, and greedy text with PEFT LoRA adapters
(ranks 4 to 32, every target module, Phi-3's fused ones) in one mixed batch equals PEFT's, on each LoRA route (the
Triton kernels under the interpreter). The models are small and random (tests/model_families.py), with windows shorter
than the sequences, so an attention route that ignores a window, a norm applied the Llama way, or a delta landing on
the wrong slice of a fused projection is caught."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from model_families import FAMILIES, build_family
from test_model import check_prefill_decode_mixed, cpu_model, hf_atol
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.request import SamplingParams
from engine.model.config import load_model_config, parse_model_config
from engine.model.decoder import RotaryEmbedding
from loragate_kernels.backends import Machine

from lora_fixtures import make_peft_adapter, peft_greedy

NEW_TOKENS = 8
ROUTES = ("torch", "cpp")  # the layer ops and attention (engine/model/layer_ops.py, engine/model/attention.py)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {family: build_family(family, root / family, seed=i) for i, family in enumerate(FAMILIES)}


def _force(monkeypatch: pytest.MonkeyPatch, route: str) -> None:
    if route == "cpp" and not Machine.probe(torch.device("cpu")).cpu_ops:
        pytest.skip(f"the CPU ops cannot be built here: {Machine.probe(torch.device('cpu')).cpu_ops_problem}")
    for seam in ("LAYER", "ATTENTION", "LORA"):
        monkeypatch.setenv(f"LORAGATE_{seam}_BACKEND", route)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_hf(family_dirs: dict[str, Path], family: str, route: str, monkeypatch) -> None:
    _force(monkeypatch, route)
    model_dir = family_dirs[family]
    ours = cpu_model(model_dir, torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert ours.config.model_type == hf.config.model_type
    # Gemma's embeddings are scaled by sqrt(hidden) and its logits come out larger: the tolerance scales with them
    scale = 4.0 if ours.config.gemma_norms else 1.0
    check_prefill_decode_mixed(ours, hf, block_size=4, atol=scale * hf_atol(route, "onednn"))


def test_windows_change_the_output(family_dirs: dict[str, Path]) -> None:
    """The families' windows are short enough to matter: the same weights without them give other logits (so the
    comparisons above would catch a route that ignores them)."""
    model_dir = family_dirs["gemma3"]
    tokens = torch.randint(3, 200, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        windowed = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)(tokens).logits
        unwindowed = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, sliding_window=512)
        assert (windowed - unwindowed(tokens).logits).abs().max() > 1e-2


ADAPTERS = {  # name -> LoraConfig arguments; Phi-3's projections are fused (qkv_proj, gate_up_proj)
    "r4-all": dict(r=4, alpha=8, targets="all-linear"),
    "r16-attn": dict(r=16, alpha=16, targets=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "r32-mlp": dict(r=32, alpha=16, targets=["gate_proj", "up_proj", "down_proj"], use_rslora=True),
}
PHI3_ADAPTERS = {
    "r4-all": dict(r=4, alpha=8, targets="all-linear"),
    "r16-qkv": dict(r=16, alpha=16, targets=["qkv_proj", "o_proj"]),
    "r32-mlp": dict(r=32, alpha=16, targets=["gate_up_proj", "down_proj"], use_rslora=True),
}


@pytest.mark.parametrize("route", ("torch", "cpp", "triton"))
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma3", "phi3", "mistral"])
def test_mixed_lora_batch_matches_peft(
    family_dirs: dict[str, Path], family: str, route: str, tmp_path: Path, monkeypatch
) -> None:
    """Base rows and three adapters of ranks 4, 16 and 32 in one batch, greedy, each request equal to PEFT's."""
    if route == "triton":
        monkeypatch.setenv("LORAGATE_LORA_BACKEND", "triton")
        monkeypatch.setenv("LORAGATE_ATTENTION_BACKEND", "triton")
    else:
        _force(monkeypatch, route)
    model_dir = family_dirs[family]
    specs = PHI3_ADAPTERS if family == "phi3" else ADAPTERS
    adapters = {
        name: make_peft_adapter(model_dir, tmp_path / name, seed=i, b_std=0.3, **kw)
        for i, (name, kw) in enumerate(specs.items())
    }
    if family == "phi3":  # PEFT names the fused projections: the deltas land on their slices
        saved = json.loads((adapters["r16-qkv"] / "adapter_config.json").read_text())["target_modules"]
        assert set(saved) == {"qkv_proj", "o_proj"}
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (9, 3, 14)]
    jobs = [(name, p) for name in [None, *adapters] for p in prompts[:2]] + [(None, prompts[2]), ("r4-all", prompts[2])]
    engine = LLMEngine(
        EngineConfig(dtype="float32", model=str(model_dir), adapter_dir=str(tmp_path), max_model_len=128)
    )
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    requests = [engine.add_request(f"j{i}", p, params, adapter_id=a) for i, (a, p) in enumerate(jobs)]
    while engine.has_unfinished_requests():
        engine.step()
    expected = {}
    for adapter, prompt in jobs:
        key = (adapter, tuple(prompt))
        if key not in expected:
            expected[key] = peft_greedy(model_dir, None if adapter is None else adapters[adapter], prompt, NEW_TOKENS)
    for (adapter, prompt), request in zip(jobs, requests, strict=True):
        assert request.output_token_ids == expected[(adapter, tuple(prompt))], (family, route, adapter)
    base = expected[(None, tuple(prompts[0]))]
    assert sum(expected[(name, tuple(prompts[0]))] != base for name in adapters) >= 2  # the adapters change the text


def test_phi3_long_factors_match_hf(family_dirs: dict[str, Path]) -> None:
    """Past the original context, the cos/sin tables are transformers' longrope tables with the long factors (and the
    attention factor), partial rotary included; before it, the short factors'."""
    model_dir = family_dirs["phi3"]
    config = load_model_config(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ours = RotaryEmbedding(config, config.rope_parameters["full_attention"])
    x = torch.zeros(1, 1, dtype=torch.float32)
    for positions in (torch.arange(0, 64), torch.arange(64, 90)):
        cos, sin = hf.model.rotary_emb(x, positions[None])
        half = cos.shape[-1] // 2
        sign = torch.ones(cos.shape[-1])
        sign[:half] = -1  # ours folds rotate_half's sign into sin
        torch.testing.assert_close(ours.cos[positions], cos[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(ours.sin[positions], sin[0] * sign, rtol=0, atol=1e-5)
    assert ours.cos.shape[-1] == int(config.head_dim * 0.75)


BASE = dict(
    model_type="gemma3_text",
    architectures=["Gemma3ForCausalLM"],
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=256,
)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "dynamic"),
        ({"hidden_activation": "relu"}, "relu"),
        ({"layer_types": ["full_attention", "chunked_attention"]}, "chunked_attention"),
        ({"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"]}, "Gemma2ForCausalLM"),
        (
            {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 0.1},
            "partial_rotary_factor",
        ),
    ],
)
def test_configs_it_cannot_serve_are_refused_naming_the_field(overrides: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        parse_model_config({**BASE, **overrides}, {})


def test_older_transformers_fields_read_as_transformers_5_normalizes_them() -> None:
    """transformers before 5 gave configs without `layer_types` and `rope_parameters`: the families' older fields
    (Gemma 3's sliding_window_pattern and rope_local_base_freq, Qwen2's use_sliding_window and max_window_layers,
    rope_theta and rope_scaling) give what transformers 5 makes of the same config.json."""
    import transformers

    from engine.model.config import _layer_types, _rope_parameters

    gemma = {"num_hidden_layers": 7, "sliding_window": 4, "sliding_window_pattern": 3, "rope_theta": 1e6}
    gemma |= {"rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "head_dim": 16}
    qwen = {"num_hidden_layers": 5, "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2}
    qwen |= {"rope_theta": 5e5, "rope_scaling": None}
    for model_type, fields, config_class in [
        ("gemma3_text", gemma, transformers.Gemma3TextConfig),
        ("qwen2", qwen, transformers.Qwen2Config),
    ]:
        new = config_class(**fields, max_position_embeddings=64)
        old = SimpleNamespace(**fields, max_position_embeddings=64, num_attention_heads=4, hidden_size=64)
        assert _layer_types(model_type, old) == _layer_types(model_type, new)
        types = _layer_types(model_type, new)[0]
        assert _rope_parameters(old, types, 16) == _rope_parameters(new, types, 16)
        assert len(set(types)) == 2  # both kinds of layer, so the comparison says something


def test_a_window_longer_than_the_context_is_plain_attention() -> None:
    """Mistral configs often set sliding_window to the whole context: no layer slides then."""
    raw = {**BASE, "model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 4096}
    config = parse_model_config(raw, {})
    assert config.sliding_window == 0 and set(config.layer_types) == {"full_attention"}
