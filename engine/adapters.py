"""PEFT LoRA adapters: validate and parse adapter directories, keep a registry, cache weights in host RAM.

An adapter directory holds `adapter_config.json` and `adapter_model.safetensors` as PEFT's
`save_pretrained` writes them. Registering reads the config and the safetensors *header* only (names,
shapes, dtypes), so a registered adapter costs a few KB; weights are read on first use into a
byte-bounded LRU in host RAM. Only the safetensors library reads tensors: pickle files are never loaded.

Which (layer, module) pairs an adapter adapts, and each pair's rank and scale, follow PEFT's rules
(checked against PEFT 0.21 in tests/test_adapters.py) applied to LlamaForCausalLM module names
("model.layers.{i}.self_attn.q_proj", "model.layers.{i}.mlp.down_proj"):
- target_modules: a list matches a name equal to an entry or ending in "." + entry, optionally limited to
  layers_to_transform (layer index found via layers_pattern); a string is a regex that must match the
  whole name (layers_to_transform is then ignored, as in PEFT); "all-linear" means all seven projections.
  exclude_modules removes names by the same rules.
- rank_pattern / alpha_pattern: the first key, in file order, such that the name matches `(.*\\.)?(key)$`
  overrides r / lora_alpha. scale = lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora.
Regexes come from adapter files, so adapter directories must be trusted not to hold pathological ones.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from engine.model.loader import ModelConfig

logger = logging.getLogger(__name__)

MODULES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_ID_LEN = 128
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_ATTN = frozenset(("q_proj", "k_proj", "v_proj", "o_proj"))
_ID_RE = re.compile(r"[A-Za-z0-9._-]+")
_KEY_RE = re.compile(
    r"base_model\.model\.model\.layers\.(\d{1,6})\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight"
)
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
_FLOAT_DTYPES = frozenset(("F16", "BF16", "F32", "F64"))
_MAX_CONFIG_BYTES = 1 << 20
_MAX_PATTERN_LEN = 1000
_LLAMA_DEFAULT_TARGETS = ("q_proj", "v_proj")  # PEFT's default when target_modules is null
# LoraConfig options that change the forward pass or add weights we do not apply: any truthy value is refused.
_UNSUPPORTED = {
    "use_dora": "DoRA", "lora_bias": "a bias on lora_B", "modules_to_save": "modules_to_save",
    "trainable_token_indices": "trainable tokens", "target_parameters": "target_parameters",
    "layer_replication": "layer replication", "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "use_qalora": "QA-LoRA", "use_bdlora": "block-diagonal LoRA", "arrow_config": "Arrow routing",
    "kasa_config": "KaSA", "monteclora_config": "MonteCLoRA",
}
# Initialisations that also rewrite the base weights: such an adapter is wrong on the original base.
_BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


class AdapterError(ValueError):
    """An adapter id, directory or file is unusable; the message says which adapter and why."""


_Fail = Callable[[str], AdapterError]  # builds an error that names the adapter


def validate_adapter_id(adapter_id: str) -> str:
    """Return `adapter_id` if it is 1..128 of [A-Za-z0-9._-], not starting with '.', without '..'."""
    if not isinstance(adapter_id, str) or not 1 <= len(adapter_id) <= MAX_ID_LEN:
        raise AdapterError(f"adapter id must be a string of 1 to {MAX_ID_LEN} characters")
    if _ID_RE.fullmatch(adapter_id) is None or adapter_id.startswith(".") or ".." in adapter_id:
        raise AdapterError(
            f"invalid adapter id {adapter_id!r}: use letters, digits, '.', '_' and '-', "
            "not starting with '.' and without '..'"
        )
    return adapter_id


@dataclass(frozen=True, slots=True)
class LoraTarget:
    rank: int
    scale: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora


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
    nbytes: int  # fp32 bytes of all A and B
    stamp: tuple[int, int, int]  # (size, mtime_ns, inode) of the weights file when it was read

    def targets(self) -> Iterator[tuple[int, str, LoraTarget]]:
        """(layer, module, target) for every adapted pair, layer-major, modules in MODULES order."""
        for layer, by_module in enumerate(self.layers):
            for module in MODULES:
                if module in by_module:
                    yield layer, module, by_module[module]


@dataclass(frozen=True, slots=True)
class LoraWeights:
    spec: AdapterSpec
    # [num_layers] of {module: (A [r, in_features], B_scaled [out_features, r])}: y += (x @ A.T) @ B_scaled.T
    layers: tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], ...] = field(hash=False, compare=False)
    nbytes: int


def module_features(model: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of a Llama projection."""
    q_out, kv_out = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    return {
        "q_proj": (model.hidden_size, q_out), "k_proj": (model.hidden_size, kv_out),
        "v_proj": (model.hidden_size, kv_out), "o_proj": (q_out, model.hidden_size),
        "gate_proj": (model.hidden_size, model.intermediate_size),
        "up_proj": (model.hidden_size, model.intermediate_size),
        "down_proj": (model.intermediate_size, model.hidden_size),
    }[module]


def _module_name(layer: int, module: str) -> str:
    return f"model.layers.{layer}.{'self_attn' if module in _ATTN else 'mlp'}.{module}"


def _tensor_key(layer: int, module: str, part: str) -> str:
    return f"base_model.model.{_module_name(layer, module)}.lora_{part}.weight"


# ---- the adapter directory -------------------------------------------------------------------------


def _adapter_dir(adapter_id: str, path: Path | str) -> Path:
    try:
        root = Path(os.path.realpath(os.fspath(path)))
        is_dir, exists = root.is_dir(), root.exists()
    except (TypeError, ValueError, OSError) as exc:
        raise AdapterError(f"adapter {adapter_id!r}: unusable path {str(path)[:200]!r} ({exc})") from None
    if not exists:
        raise AdapterError(f"adapter {adapter_id!r}: path {str(path)[:200]!r} does not exist")
    if not is_dir:
        raise AdapterError(f"adapter {adapter_id!r}: path {str(path)[:200]!r} is not a directory")
    return root


def _file_in(adapter_id: str, root: Path, name: str) -> Path | None:
    """The real path of `root/name`, None if absent; refuses symlinks out of `root` and non-files."""
    link = root / name
    if not link.exists() and not link.is_symlink():
        return None
    real = Path(os.path.realpath(link))
    if not real.is_relative_to(root):
        raise AdapterError(
            f"adapter {adapter_id!r}: {name} is a symlink pointing outside the adapter directory"
        )
    if not real.is_file():
        raise AdapterError(f"adapter {adapter_id!r}: {name} is not a regular file")
    return real


def _weights_file(adapter_id: str, root: Path) -> Path:
    found = _file_in(adapter_id, root, WEIGHTS_FILE)
    if found is not None:
        return found
    pickled = sorted(p.name for p in root.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickled:
        raise AdapterError(
            f"adapter {adapter_id!r} has only pickled weights ({', '.join(pickled[:5])}); pickle files are "
            f"never loaded: save it with safe_serialization=True to get {WEIGHTS_FILE}"
        )
    raise AdapterError(f"adapter {adapter_id!r}: directory has no {WEIGHTS_FILE}")


def _stamp(file: Path) -> tuple[int, int, int]:
    st = file.stat()
    return st.st_size, st.st_mtime_ns, st.st_ino


def _read_config(adapter_id: str, root: Path) -> dict[str, Any]:
    file = _file_in(adapter_id, root, CONFIG_FILE)
    if file is None:
        raise AdapterError(f"adapter {adapter_id!r}: directory has no {CONFIG_FILE}")
    if file.stat().st_size > _MAX_CONFIG_BYTES:
        raise AdapterError(f"adapter {adapter_id!r}: {CONFIG_FILE} is larger than {_MAX_CONFIG_BYTES} bytes")
    try:
        raw = json.loads(file.read_bytes())
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise AdapterError(f"adapter {adapter_id!r}: {CONFIG_FILE} is not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"adapter {adapter_id!r}: {CONFIG_FILE} is not a JSON object")
    return raw


# ---- adapter_config.json -> which (layer, module) pairs, with which rank and scale ------------------


@dataclass(frozen=True, slots=True)
class _LoraConfig:
    r: int
    alpha: float
    use_rslora: bool
    targets: tuple[str, ...] | str  # names, or a regex over full module names
    exclude: tuple[str, ...] | str
    layers: tuple[int, ...] | None  # layers_to_transform
    layers_pattern: tuple[str, ...]
    rank_pattern: tuple[tuple[str, int], ...]  # in file order: the first matching key wins
    alpha_pattern: tuple[tuple[str, float], ...]


def _parse_config(adapter_id: str, raw: dict[str, Any]) -> _LoraConfig:
    def fail(msg: str) -> AdapterError:
        return AdapterError(f"adapter {adapter_id!r}: {msg}")

    if raw.get("peft_type") != "LORA":
        raise fail(f"peft_type is {raw.get('peft_type')!r}; only LoRA adapters (peft_type 'LORA') "
                   "are supported")
    for key, what in _UNSUPPORTED.items():
        if raw.get(key):
            raise fail(f"{key}={str(raw[key])[:100]}: {what} is not supported")
    if raw.get("bias", "none") != "none":
        raise fail(f"bias={raw['bias']!r} is not supported (only 'none')")
    init = raw.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_REWRITING_INITS):
        raise fail(f"init_lora_weights={init!r} also rewrites the base weights; convert the adapter to plain "
                   "LoRA (save_pretrained(path_initial_model_for_weight_conversion=...)) first")
    targets = raw.get("target_modules")
    if isinstance(targets, str) and targets.lower() == "all-linear":
        targets = list(MODULES)
    indices = raw.get("layers_to_transform")
    return _LoraConfig(
        r=_rank(fail, "r", raw.get("r", 8)),
        alpha=_number(fail, "lora_alpha", raw.get("lora_alpha", 8)),
        use_rslora=bool(raw.get("use_rslora", False)),
        targets=_names(fail, "target_modules", targets, _LLAMA_DEFAULT_TARGETS),
        exclude=_names(fail, "exclude_modules", raw.get("exclude_modules"), ()),
        layers=None if indices in (None, []) else _int_list(fail, "layers_to_transform", indices),
        layers_pattern=_str_list(fail, "layers_pattern", raw.get("layers_pattern")),
        rank_pattern=_pattern(fail, "rank_pattern", raw.get("rank_pattern"), _rank),
        alpha_pattern=_pattern(fail, "alpha_pattern", raw.get("alpha_pattern"), _number),
    )


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


def _pattern(fail: _Fail, what: str, value: Any,
             parse: Callable[[_Fail, str, Any], Any]) -> tuple[tuple[str, Any], ...]:
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


def _in_layers(cfg: _LoraConfig, name: str) -> bool:
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


def _plan(adapter_id: str, cfg: _LoraConfig, model: ModelConfig) -> tuple[dict[str, LoraTarget], ...]:
    """[num_layers] of {module: LoraTarget} for the pairs the config targets on this base model."""
    layers: tuple[dict[str, LoraTarget], ...] = tuple({} for _ in range(model.num_layers))
    names = [(layer, module, _module_name(layer, module))
             for layer in range(model.num_layers) for module in MODULES]
    try:
        for layer, module, name in names:
            if not _matches(cfg.targets, name) or not _in_layers(cfg, name) or _matches(cfg.exclude, name):
                continue
            r = _override(cfg.rank_pattern, name, cfg.r)
            alpha = _override(cfg.alpha_pattern, name, cfg.alpha)
            layers[layer][module] = LoraTarget(r, alpha / math.sqrt(r) if cfg.use_rslora else alpha / r)
    except re.error as exc:
        raise AdapterError(f"adapter {adapter_id!r}: invalid layers_pattern ({exc})") from None
    if not isinstance(cfg.targets, str):
        unknown = [t for t in cfg.targets if not any(_matches((t,), name) for _, _, name in names)]
        if unknown:
            raise AdapterError(
                f"adapter {adapter_id!r} targets {', '.join(map(repr, unknown[:5]))}: loragate applies "
                f"LoRA only to {', '.join(MODULES)} of the {model.num_layers} decoder layers"
            )
    if not any(layers):
        raise AdapterError(f"adapter {adapter_id!r}: adapter_config.json targets no module of the base model")
    return layers


# ---- the safetensors file ----------------------------------------------------------------------------


def _read_header(adapter_id: str, file: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """{tensor name: (shape, safetensors dtype)}, from the header only."""
    try:
        with safe_open(file, framework="pt") as f:
            slices = {key: f.get_slice(key) for key in f.keys()}
            return {key: (tuple(piece.get_shape()), piece.get_dtype()) for key, piece in slices.items()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterError(
            f"adapter {adapter_id!r}: {WEIGHTS_FILE} is not a valid safetensors file ({exc})"
        ) from None


def _check_tensors(adapter_id: str, header: dict[str, tuple[tuple[int, ...], str]],
                   layers: tuple[dict[str, LoraTarget], ...], model: ModelConfig) -> None:
    """The file holds exactly an A and a B of the right shape and a float dtype for every planned pair."""
    found: set[tuple[int, str]] = set()
    unknown = []
    for key, (_, dtype) in header.items():
        m = _KEY_RE.fullmatch(key)
        if m is None or m[3] not in MODULES or (m[2] == "self_attn") != (m[3] in _ATTN) \
                or int(m[1]) >= model.num_layers:
            unknown.append(key)
        elif dtype not in _FLOAT_DTYPES:
            raise AdapterError(f"adapter {adapter_id!r}: tensor {key} has dtype {dtype}, not a float type")
        else:
            found.add((int(m[1]), m[3]))
    if unknown:
        raise AdapterError(
            f"adapter {adapter_id!r}: {WEIGHTS_FILE} holds {len(unknown)} tensor(s) for modules loragate "
            f"does not adapt on this base model, e.g. {', '.join(sorted(unknown)[:3])}"
        )
    for layer, module in sorted(found):
        if module not in layers[layer]:
            raise AdapterError(f"adapter {adapter_id!r} has weights for {_module_name(layer, module)}, "
                               "which its adapter_config.json does not target")
    for layer, by_module in enumerate(layers):
        for module, target in by_module.items():
            for part, expected in _expected_shapes(model, module, target.rank):
                key = _tensor_key(layer, module, part)
                if key not in header:
                    raise AdapterError(f"adapter {adapter_id!r}: {WEIGHTS_FILE} lacks {key}, "
                                       f"but adapter_config.json targets {_module_name(layer, module)}")
                _check_shape(adapter_id, key, header[key][0], expected, target.rank)


def _expected_shapes(model: ModelConfig, module: str, rank: int) -> tuple[tuple[str, tuple[int, int]], ...]:
    in_features, out_features = module_features(model, module)
    return ("A", (rank, in_features)), ("B", (out_features, rank))


def _check_shape(adapter_id: str, key: str, shape: tuple[int, ...], expected: tuple[int, int],
                 rank: int) -> None:
    if tuple(shape) != expected:
        raise AdapterError(
            f"adapter {adapter_id!r}: tensor {key} has shape {list(shape)}, expected {list(expected)} (rank "
            f"{rank} from adapter_config.json, features from the base model); "
            "was it trained on another model?"
        )


def read_adapter(path: Path, adapter_id: str, version: int, model: ModelConfig) -> AdapterSpec:
    """Validate an adapter directory from its config and safetensors header (no tensor data is read)."""
    validate_adapter_id(adapter_id)
    root = _adapter_dir(adapter_id, path)
    cfg = _parse_config(adapter_id, _read_config(adapter_id, root))
    weights_file = _weights_file(adapter_id, root)
    layers = _plan(adapter_id, cfg, model)
    _check_tensors(adapter_id, _read_header(adapter_id, weights_file), layers, model)
    ranks = [t.rank for by_module in layers for t in by_module.values()]
    num_params = sum(target.rank * sum(module_features(model, module))
                     for by_module in layers for module, target in by_module.items())
    return AdapterSpec(
        adapter_id=adapter_id, version=version, path=root, layers=layers,
        modules=tuple(m for m in MODULES if any(m in by_module for by_module in layers)),
        max_rank=max(ranks), num_params=num_params, nbytes=4 * num_params, stamp=_stamp(weights_file),
    )


def load_weights(spec: AdapterSpec, model: ModelConfig, dtype: torch.dtype) -> LoraWeights:
    """Read an adapter's A and B (scale folded into B) as contiguous CPU tensors of `dtype`."""
    if not dtype.is_floating_point:
        raise ValueError(f"adapter weights need a floating dtype, got {dtype}")
    if len(spec.layers) != model.num_layers:
        raise ValueError(f"spec of adapter {spec.adapter_id!r} was read for a {len(spec.layers)}-layer model")
    weights_file = _weights_file(spec.adapter_id, spec.path)
    if _stamp(weights_file) != spec.stamp:
        raise AdapterError(f"adapter {spec.adapter_id!r}: {WEIGHTS_FILE} changed on disk since version "
                           f"{spec.version} was registered; register it again")
    layers: tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], ...] = tuple({} for _ in spec.layers)
    try:
        with safe_open(weights_file, framework="pt", device="cpu") as f:
            for layer, module, target in spec.targets():
                (_, a_shape), (_, b_shape) = _expected_shapes(model, module, target.rank)
                a = _read_tensor(spec.adapter_id, f, _tensor_key(layer, module, "A"), a_shape, target.rank)
                b = _read_tensor(spec.adapter_id, f, _tensor_key(layer, module, "B"), b_shape, target.rank)
                layers[layer][module] = (_cast(spec, a, dtype, "A", layer, module),
                                         _cast(spec, b * target.scale, dtype, "B", layer, module))
    except (SafetensorError, OSError) as exc:
        raise AdapterError(f"adapter {spec.adapter_id!r}: cannot read {WEIGHTS_FILE} ({exc})") from None
    nbytes = sum(t.numel() * t.element_size()
                 for by_module in layers for pair in by_module.values() for t in pair)
    return LoraWeights(spec=spec, layers=layers, nbytes=nbytes)


def _read_tensor(adapter_id: str, f: Any, key: str, shape: tuple[int, int], rank: int) -> torch.Tensor:
    tensor = f.get_tensor(key)  # the file may have been replaced with a same-stamp one: check again
    _check_shape(adapter_id, key, tuple(tensor.shape), shape, rank)
    # Always a copy: safetensors may hand out tensors backed by an mmap of the file, which a later
    # overwrite of the file would silently change under the cache.
    return tensor.to(torch.float32, copy=True)


def _cast(spec: AdapterSpec, tensor: torch.Tensor, dtype: torch.dtype, part: str, layer: int,
          module: str) -> torch.Tensor:
    out = tensor.to(dtype).contiguous()
    if not bool(torch.isfinite(out).all()):
        in_dtype = "" if dtype == torch.float32 else f" in {dtype}"
        raise AdapterError(f"adapter {spec.adapter_id!r}: lora_{part} of {_module_name(layer, module)} has "
                           f"non-finite values (NaN or inf){in_dtype}")
    return out


# ---- registry and host cache ---------------------------------------------------------------------------


class AdapterRegistry:
    """Registered adapters by id; thread-safe (the HTTP thread registers while the engine thread reads)."""

    def __init__(self, model: ModelConfig) -> None:
        self._model = model
        self._lock = threading.Lock()
        self._specs: dict[str, AdapterSpec] = {}
        # Survives unregister(): a re-registered id never reuses a version, so caches keyed by
        # (id, version) never serve an older content.
        self._versions: dict[str, int] = {}

    def register(self, adapter_id: str, path: Path) -> AdapterSpec:
        """Validate and (re-)register an adapter; the first registration of an id is version 1."""
        validate_adapter_id(adapter_id)
        spec = read_adapter(path, adapter_id, 0, self._model)  # file reads happen outside the lock
        with self._lock:
            version = self._versions.get(adapter_id, 0) + 1
            self._versions[adapter_id] = version
            spec = dataclasses.replace(spec, version=version)
            self._specs[adapter_id] = spec
        logger.info("registered adapter %s v%d from %s (modules %s, max rank %d, %.1f MB fp32)", adapter_id,
                    version, spec.path, ",".join(spec.modules), spec.max_rank, spec.nbytes / 2**20)
        return spec

    def unregister(self, adapter_id: str) -> AdapterSpec:
        """Remove an adapter; KeyError if it is not registered."""
        with self._lock:
            spec = self._specs.pop(adapter_id)
        logger.info("unregistered adapter %s v%d", adapter_id, spec.version)
        return spec

    def get(self, adapter_id: str) -> AdapterSpec:
        """The current spec of an adapter; KeyError if it is not registered."""
        with self._lock:
            return self._specs[adapter_id]

    def list(self) -> list[AdapterSpec]:
        with self._lock:
            return sorted(self._specs.values(), key=lambda spec: spec.adapter_id)

    def scan_dir(self, adapter_dir: Path) -> list[AdapterSpec]:
        """Register every subdirectory of `adapter_dir` under its folder name; log and skip broken ones."""
        root = Path(adapter_dir)
        if not root.is_dir():
            raise AdapterError(f"adapter directory {str(root)!r} does not exist or is not a directory")
        specs = []
        for sub in sorted(root.iterdir()):
            if not sub.is_dir():
                continue
            try:
                specs.append(self.register(validate_adapter_id(sub.name), sub))
            except AdapterError as exc:
                logger.warning("skipping %s: %s", sub, exc)
        return specs


class HostAdapterCache:
    """Parsed adapter weights in host RAM, keyed by (id, version), least recently used evicted first.

    `capacity_bytes` bounds the sum of cached LoraWeights.nbytes. Loads happen outside the lock, so two
    threads missing the same adapter at once may both read it; only one copy is kept.
    """

    def __init__(self, capacity_bytes: int, model: ModelConfig, dtype: torch.dtype) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._model = model
        self._dtype = dtype
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str, int], LoraWeights] = OrderedDict()  # oldest use first
        self._used = 0
        self.hits = self.misses = self.loads = self.evictions = 0

    @property
    def used_bytes(self) -> int:
        return self._used

    def get(self, spec: AdapterSpec) -> LoraWeights:
        """The adapter's weights: cached, or loaded (AdapterError if the file is now unusable)."""
        key = (spec.adapter_id, spec.version)
        with self._lock:
            weights = self._entries.get(key)
            if weights is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return weights
            self.misses += 1
        return self._load(spec)

    def prefetch(self, spec: AdapterSpec) -> None:
        """Load an adapter into the cache unless it is there (not counted as a hit or a miss)."""
        if not self.contains(spec):
            self._load(spec)

    def contains(self, spec: AdapterSpec) -> bool:
        with self._lock:
            return (spec.adapter_id, spec.version) in self._entries

    def discard(self, adapter_id: str) -> None:
        """Drop every cached version of an adapter."""
        with self._lock:
            for key in [key for key in self._entries if key[0] == adapter_id]:
                self._used -= self._entries.pop(key).nbytes

    def _load(self, spec: AdapterSpec) -> LoraWeights:
        weights = load_weights(spec, self._model, self._dtype)
        key = (spec.adapter_id, spec.version)
        with self._lock:
            self.loads += 1
            if key in self._entries:  # another thread loaded it meanwhile
                self._entries.move_to_end(key)
                return self._entries[key]
            if weights.nbytes > self.capacity_bytes:
                logger.warning("adapter %s (%d bytes) is larger than the host adapter cache (%d bytes); "
                               "not caching it", spec.adapter_id, weights.nbytes, self.capacity_bytes)
                return weights
            while self._used + weights.nbytes > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._used -= evicted.nbytes
                self.evictions += 1
            self._entries[key] = weights
            self._used += weights.nbytes
        return weights
