"""What a PEFT LoRA adapter adapts: adapter ids, and adapter_config.json -> (layer, module) targets.

Parsing is pure: engine/lora/files.py reads the files and hands the JSON object here. The result is a
rank and a scale for every (layer, module) pair the adapter adapts on the base model (`AdapterSpec`).

Which (layer, module) pairs an adapter adapts, and each pair's rank and scale, follow PEFT's rules
(checked against PEFT 0.21 in tests/engine/test_adapters.py) applied to the HF module names of the base's projections
("model.layers.{i}.self_attn.q_proj", "model.layers.{i}.mlp.down_proj"; Phi-3's fused "qkv_proj" and "gate_up_proj"):
- target_modules: a list matches a name equal to an entry or ending in "." + entry, optionally limited to
  layers_to_transform (layer index found via layers_pattern); a string is a regex that must match the
  whole name (layers_to_transform is then ignored, as in PEFT); "all-linear" means every projection.
  exclude_modules removes names by the same rules.
- rank_pattern / alpha_pattern: the first key, in file order, such that the name matches `(.*\\.)?(key)$`
  overrides r / lora_alpha. scale = lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora.
- the embedding and the LM head ("model.embed_tokens", "lm_head") by the same rules, with PEFT's exceptions for them
  (`plan_vocab`); their LoRA is served apart from the layers' (engine/lora/vocab_lora.py).
Regexes come from adapter files, so adapter directories must be trusted not to hold pathological ones.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from engine.model.config import ModelConfig
from loragate_common.adapter_ids import ref_problem
from loragate_common.errors import shown

MODULES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# under self_attn, the rest under mlp (qkv_proj: a checkpoint's fused q|k|v, below)
ATTENTION_MODULES = frozenset(("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj"))
# A checkpoint with fused projections (Phi-3: engine/model/config.py `fused_checkpoint`) names them, and so do the
# adapters trained on it: a LoRA on a fused module is one A shared by the modules it covers and a B whose rows split
# between them, so it is served as a LoRA on each covered module with that A and its rows of B (exact).
_FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
# The embedding and the LM head -> their HF names; LoRA on them is served apart (engine/lora/vocab_lora.py)
VOCAB_MODULES: dict[str, str] = {"embed_tokens": "model.embed_tokens", "lm_head": "lm_head"}
# Modules the model computes as one fused projection (same input, outputs side by side): the device tier
# stacks a group's A matrices so one shrink serves the whole group.
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
_MAX_PATTERN_LEN = 1000
# PEFT's default when target_modules is null, for every family it has one for (for Phi-3 it has none and refuses)
_DEFAULT_TARGETS = ("q_proj", "v_proj")
# LoraConfig options that change the forward pass or add weights we do not apply: any truthy value is refused.
_UNSUPPORTED = {
    "lora_bias": "a bias on lora_B",
    "modules_to_save": "modules_to_save (a full copy of the listed modules' weights per adapter, where loragate "
    "serves only LoRA deltas over the shared base)",
    "trainable_token_indices": "trainable tokens (a trained copy of embedding rows per adapter, where loragate "
    "serves only LoRA deltas over the shared base)",
    "target_parameters": "target_parameters",
    "layer_replication": "layer replication",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "use_qalora": "QA-LoRA",
    "use_bdlora": "block-diagonal LoRA",
    "arrow_config": "Arrow routing",
    "kasa_config": "KaSA",
    "monteclora_config": "MonteCLoRA",
}
# Initialisations that also rewrite the base weights: such an adapter is wrong on the original base.
_BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


class AdapterError(ValueError):
    """An adapter id, directory or file is unusable; the message says which adapter and why."""


_Fail = Callable[[str], AdapterError]  # builds an error that names the adapter


def validate_adapter_id(adapter_id: str) -> str:
    """Return `adapter_id` if it is `ID` or `ID@N` (loragate_common/adapter_ids.py: the gateway's catalog follows the
    same rules), else AdapterError saying why."""
    if not isinstance(adapter_id, str):
        raise AdapterError(f"adapter id must be a string, not {type(adapter_id).__name__}")
    problem = ref_problem(adapter_id)
    if problem is not None:
        raise AdapterError(f"invalid adapter id {shown(adapter_id)}: {problem}")
    return adapter_id


@dataclass(frozen=True, slots=True)
class LoraTarget:
    rank: int
    scale: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora


class AdapterKey(NamedTuple):
    """One adapter content: its id and the version a registration gave it. Caches of anything derived
    from an adapter (host weights, device residency, prefix-cache blocks) are keyed by it."""

    adapter_id: str
    version: int


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """What the registry knows of an adapter without its weights."""

    adapter_id: str
    version: int  # 1, 2, ... per id; bumped by every register(), so (id, version) names one content
    path: Path  # the resolved adapter directory
    # [num_layers] of {module: target}; a module missing from a layer's dict is not adapted there.
    layers: tuple[dict[str, LoraTarget], ...] = field(hash=False)
    modules: tuple[str, ...]  # modules adapted in at least one layer, in MODULES order
    max_rank: int
    num_params: int
    nbytes: int  # fp32 bytes of all A and B (and DoRA's magnitudes)
    stamp: tuple[int, int, int]  # (size, mtime_ns, inode) of the weights file when it was read
    # DoRA (PEFT's use_dora): every targeted module's output rows are rescaled by its saved magnitude over the row
    # norms of W + s B A (engine/lora/dora.py); the adapter is DoRA on every module it targets.
    dora: bool = False
    # LoRA on the embedding and the LM head (engine/lora/vocab_lora.py): the modules, in VOCAB_MODULES order, and
    # each one's rank and scale; `tied_head`: the head's LoRA is the embedding's, transposed (PEFT's
    # ensure_weight_tying on a base with tied embeddings).
    vocab_modules: tuple[str, ...] = ()
    vocab_targets: dict[str, LoraTarget] = field(default_factory=dict, hash=False, compare=False)
    tied_head: bool = False
    # A weighted mix's parts (the versions it was built from) and their weights: its weights are built from theirs,
    # not read from files (engine/lora/mixes.py); () for an adapter read from its directory.
    parts: tuple[tuple[AdapterSpec, float], ...] = field(default=(), hash=False, compare=False)
    # (adapter_id, version), made once: the step loop looks adapters up by it for every running request.
    key: AdapterKey = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", AdapterKey(self.adapter_id, self.version))

    @property
    def kind(self) -> str:
        """What it is, as every card says it (loragate_common/adapter_kinds.py): "LoRA", "DoRA" or "mix"."""
        return "mix" if self.parts else "DoRA" if self.dora else "LoRA"

    def targets(self) -> Iterator[tuple[int, str, LoraTarget]]:
        """(layer, module, target) for every adapted pair, layer-major, modules in MODULES order."""
        for layer, by_module in enumerate(self.layers):
            for module in MODULES:
                if module in by_module:
                    yield layer, module, by_module[module]


def module_features(model: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of a Llama projection."""
    q_out, kv_out = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    return {
        "q_proj": (model.hidden_size, q_out),
        "k_proj": (model.hidden_size, kv_out),
        "v_proj": (model.hidden_size, kv_out),
        "o_proj": (q_out, model.hidden_size),
        "gate_proj": (model.hidden_size, model.intermediate_size),
        "up_proj": (model.hidden_size, model.intermediate_size),
        "down_proj": (model.intermediate_size, model.hidden_size),
    }[module]


def module_name(layer: int, module: str) -> str:
    """The HF name of a projection, e.g. "model.layers.3.mlp.down_proj"."""
    return f"model.layers.{layer}.{'self_attn' if module in ATTENTION_MODULES else 'mlp'}.{module}"


def checkpoint_modules(model: ModelConfig) -> dict[str, tuple[str, ...]]:
    """The base's adaptable projections as its checkpoint (and so PEFT) names them -> the MODULES each covers."""
    return _FUSED_MODULES if model.fused_checkpoint else {module: (module,) for module in MODULES}


def checkpoint_module(model: ModelConfig, module: str) -> tuple[str, int]:
    """(the checkpoint's projection holding `module`, the first of its output rows that are `module`'s)."""
    for name, covered in checkpoint_modules(model).items():
        if module in covered:
            return name, sum(module_features(model, m)[1] for m in covered[: covered.index(module)])
    raise KeyError(module)


# ---- adapter_config.json -> which (layer, module) pairs, with which rank and scale ------------------


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    """The fields of adapter_config.json that decide targets, ranks and scales, validated."""

    r: int
    alpha: float
    use_rslora: bool
    targets: tuple[str, ...] | str  # names, or a regex over full module names
    exclude: tuple[str, ...] | str
    layers: tuple[int, ...] | None  # layers_to_transform
    layers_pattern: tuple[str, ...]
    rank_pattern: tuple[tuple[str, int], ...]  # in file order: the first matching key wins
    alpha_pattern: tuple[tuple[str, float], ...]
    all_linear: bool = False  # "all-linear": every projection of the base (`targets` is then empty)
    dora: bool = False  # use_dora: a lora_magnitude_vector per targeted module (engine/lora/dora.py)
    ensure_weight_tying: bool = False  # on a base with tied embeddings, tie the head's LoRA to the embedding's


def parse_config(adapter_id: str, raw: dict[str, Any]) -> AdapterConfig:
    def fail(msg: str) -> AdapterError:
        return AdapterError(f"adapter {adapter_id!r}: {msg}")

    if raw.get("peft_type") != "LORA":
        raise fail(f"peft_type is {raw.get('peft_type')!r}; only LoRA adapters (peft_type 'LORA') are supported")
    for key, what in _UNSUPPORTED.items():
        if raw.get(key):
            raise fail(f"{key}={str(raw[key])[:100]}: {what} is not supported")
    if raw.get("bias", "none") != "none":
        raise fail(f"bias={raw['bias']!r} is not supported (only 'none')")
    init = raw.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_REWRITING_INITS):
        raise fail(
            f"init_lora_weights={init!r} also rewrites the base weights; convert the adapter to plain "
            "LoRA (save_pretrained(path_initial_model_for_weight_conversion=...)) first"
        )
    targets = raw.get("target_modules")
    all_linear = isinstance(targets, str) and targets.lower() == "all-linear"
    indices = raw.get("layers_to_transform")
    return AdapterConfig(
        r=_rank(fail, "r", raw.get("r", 8)),
        alpha=_number(fail, "lora_alpha", raw.get("lora_alpha", 8)),
        use_rslora=bool(raw.get("use_rslora", False)),
        targets=() if all_linear else _names(fail, "target_modules", targets, _DEFAULT_TARGETS),
        all_linear=all_linear,
        exclude=_names(fail, "exclude_modules", raw.get("exclude_modules"), ()),
        layers=None if indices in (None, []) else _int_list(fail, "layers_to_transform", indices),
        layers_pattern=_str_list(fail, "layers_pattern", raw.get("layers_pattern")),
        rank_pattern=_pattern(fail, "rank_pattern", raw.get("rank_pattern"), _rank),
        alpha_pattern=_pattern(fail, "alpha_pattern", raw.get("alpha_pattern"), _number),
        dora=_flag(fail, "use_dora", raw.get("use_dora")),
        ensure_weight_tying=_flag(fail, "ensure_weight_tying", raw.get("ensure_weight_tying")),
    )


def _flag(fail: _Fail, what: str, value: Any) -> bool:
    if value not in (None, True, False):
        raise fail(f"{what}={str(value)[:100]!r} must be true or false")
    return bool(value)


def _rank(fail: _Fail, what: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise fail(f"{what}={value!r}: a LoRA rank must be a positive integer")
    return value


def _number(fail: _Fail, what: str, value: Any) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise fail(f"{what}={value!r} is not a finite number")
    return float(value)


def _str_list(fail: _Fail, what: str, value: Any) -> tuple[str, ...]:
    items = [] if value is None else [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
        raise fail(f"{what} must be a string or a list of strings")
    return tuple(items)


def _int_list(fail: _Fail, what: str, value: Any) -> tuple[int, ...]:
    items = [value] if isinstance(value, int) else value
    if not isinstance(items, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in items):
        raise fail(f"{what} must be an integer or a list of integers")
    return tuple(items)


def _names(fail: _Fail, what: str, value: Any, default: tuple[str, ...]) -> tuple[str, ...] | str:
    if value is None:
        return default
    if isinstance(value, str):
        _check_regex(fail, what, value)
        return value
    return _str_list(fail, what, value)


def _check_regex(fail: _Fail, what: str, pattern: str) -> None:
    if len(pattern) > _MAX_PATTERN_LEN:
        raise fail(f"{what} pattern is longer than {_MAX_PATTERN_LEN} characters")
    try:
        re.compile(pattern)
    except re.error as exc:
        raise fail(f"{what} {pattern[:100]!r} is not a valid regex ({exc})") from None


def _pattern(
    fail: _Fail, what: str, value: Any, parse: Callable[[_Fail, str, Any], Any]
) -> tuple[tuple[str, Any], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise fail(f"{what} must be a JSON object")
    for key in value:
        _check_regex(fail, what, rf"(.*\.)?({key})$")
    return tuple((key, parse(fail, f"{what}[{key!r}]", v)) for key, v in value.items())


def _matches(names: tuple[str, ...] | str, name: str) -> bool:
    """PEFT's target_modules / exclude_modules rule for one full module name."""
    if isinstance(names, str):
        return re.fullmatch(names, name) is not None
    return any(name == n or name.endswith("." + n) for n in names)


def _in_layers(cfg: AdapterConfig, name: str) -> bool:
    """PEFT's layers_to_transform rule: for list targets only; the first numbered segment is the layer."""
    if cfg.layers is None or isinstance(cfg.targets, str):
        return True
    if not cfg.layers_pattern:
        found = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", name)
    else:
        found = None
        for pattern in cfg.layers_pattern:
            found = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", name)
            if found is not None:
                break
    return found is not None and int(found["idx"]) in cfg.layers


def _override(pattern: tuple[tuple[str, Any], ...], name: str, default: Any) -> Any:
    for key, value in pattern:
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def plan_targets(adapter_id: str, cfg: AdapterConfig, model: ModelConfig) -> tuple[dict[str, LoraTarget], ...]:
    """[num_layers] of {module: LoraTarget} for the pairs the config targets on this base model. The rules match the
    checkpoint's names (`checkpoint_modules`); a target on a fused projection adapts every module it covers."""
    layers: tuple[dict[str, LoraTarget], ...] = tuple({} for _ in range(model.num_layers))
    covered = checkpoint_modules(model)
    names = [(layer, name, module_name(layer, name)) for layer in range(model.num_layers) for name in covered]
    try:
        for layer, checkpoint_name, name in names:
            targeted = (cfg.all_linear or _matches(cfg.targets, name)) and _in_layers(cfg, name)
            if not targeted or _matches(cfg.exclude, name):
                continue
            r = _override(cfg.rank_pattern, name, cfg.r)
            alpha = _override(cfg.alpha_pattern, name, cfg.alpha)
            for module in covered[checkpoint_name]:
                layers[layer][module] = LoraTarget(r, alpha / math.sqrt(r) if cfg.use_rslora else alpha / r)
    except re.error as exc:
        raise AdapterError(f"adapter {adapter_id!r}: invalid layers_pattern ({exc})") from None
    if not isinstance(cfg.targets, str):
        known = [name for _, _, name in names] + list(VOCAB_MODULES.values())
        unknown = [t for t in cfg.targets if not any(_matches((t,), name) for name in known)]
        if unknown:
            raise AdapterError(
                f"adapter {adapter_id!r} targets {', '.join(map(repr, unknown[:5]))}: loragate applies "
                f"LoRA only to {', '.join(covered)} of the {model.num_layers} decoder layers, embed_tokens and lm_head"
            )
    if not any(layers) and not plan_vocab(adapter_id, cfg, model).targets:
        raise AdapterError(f"adapter {adapter_id!r}: adapter_config.json targets no module of the base model")
    return layers


class VocabPlan(NamedTuple):
    targets: dict[str, LoraTarget]  # in VOCAB_MODULES order
    tied_head: bool  # the head's LoRA is the embedding's, transposed, with the head's own scale


def plan_vocab(adapter_id: str, cfg: AdapterConfig, model: ModelConfig) -> VocabPlan:
    """LoRA on the embedding and the LM head by PEFT's rules: their HF names (VOCAB_MODULES) are matched as the
    layers' are, except that an exact name in a target list ignores layers_to_transform while a layer filter leaves
    out a name matched by its suffix (it has no layer index); "all-linear" takes neither (PEFT leaves the output layer
    out, and an embedding is not a linear layer). On a base with tied embeddings, ensure_weight_tying with either
    module among the targets makes PEFT target the embedding and tie the head's LoRA to it (its A is the embedding's
    B transposed, its B the embedding's A transposed; its rank is the embedding's, its scale its own). Without it the
    two LoRAs are independent even on a tied base: one on embed_tokens changes the input embeddings only."""
    tie = cfg.ensure_weight_tying and model.tie_word_embeddings and _names_vocab(cfg.targets)
    targets: dict[str, LoraTarget] = {}
    for module, name in VOCAB_MODULES.items():
        listed = (tie and module == "embed_tokens") or (not tie and _vocab_targeted(cfg, name))
        if listed and not _matches(cfg.exclude, name):
            targets[module] = _target(cfg, name)
    if tie:
        if "embed_tokens" not in targets:
            raise AdapterError(
                f"adapter {adapter_id!r}: ensure_weight_tying ties lm_head's LoRA to embed_tokens', which "
                "exclude_modules leaves out (PEFT cannot load such an adapter either)"
            )
        targets["lm_head"] = LoraTarget(targets["embed_tokens"].rank, _target(cfg, VOCAB_MODULES["lm_head"]).scale)
    if targets and cfg.dora:
        raise AdapterError(f"adapter {adapter_id!r}: DoRA on {' and '.join(targets)} is not supported")
    return VocabPlan(targets, bool(tie))


def _names_vocab(targets: tuple[str, ...] | str) -> bool:
    """PEFT's test of whether target_modules name the embedding or the LM head (a regex is matched against the bare
    module names)."""
    if isinstance(targets, str):
        return any(re.fullmatch(targets, module) for module in VOCAB_MODULES)
    return any(t.split(".")[-1] in VOCAB_MODULES for t in targets)


def _vocab_targeted(cfg: AdapterConfig, name: str) -> bool:
    if isinstance(cfg.targets, str):
        return re.fullmatch(cfg.targets, name) is not None
    return name in cfg.targets or (cfg.layers is None and _matches(cfg.targets, name))


def _target(cfg: AdapterConfig, name: str) -> LoraTarget:
    r = _override(cfg.rank_pattern, name, cfg.r)
    alpha = _override(cfg.alpha_pattern, name, cfg.alpha)
    return LoraTarget(r, alpha / math.sqrt(r) if cfg.use_rslora else alpha / r)
