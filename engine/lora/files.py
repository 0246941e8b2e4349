"""PEFT LoRA adapter directories: validate the files, read the safetensors header, load the weights.

An adapter directory holds `adapter_config.json` and `adapter_model.safetensors` as PEFT's
`save_pretrained` writes them. `read_adapter` reads the config and the safetensors *header* only (names,
shapes, dtypes), so a registered adapter costs a few KB; `load_weights` reads the tensors on first use.
Only the safetensors library reads tensors: pickle files are never loaded.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from engine.lora.peft_config import (
    ATTENTION_MODULES,
    MODULES,
    AdapterError,
    AdapterSpec,
    LoraTarget,
    checkpoint_module,
    checkpoint_modules,
    module_features,
    module_name,
    parse_config,
    plan_targets,
    plan_vocab,
    validate_adapter_id,
)
from engine.lora.vocab_lora import BaseVocab, VocabWeights, check_vocab_file, read_vocab_weights, vocab_params
from engine.model.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY_RE = re.compile(r"base_model\.model\.model\.layers\.(\d{1,6})\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
# DoRA's magnitude of a checkpoint projection, [out_features] beside its lora_A and lora_B (no ".weight" suffix)
_MAGNITUDE_SUFFIX = ".lora_magnitude_vector"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
_FLOAT_DTYPES = frozenset(("F16", "BF16", "F32", "F64"))
_MAX_CONFIG_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class LoraWeights:
    """An adapter's A and scale-folded B tensors, on the CPU."""

    spec: AdapterSpec
    # [num_layers] of {module: (A [r, in_features], B_scaled [out_features, r])}: y += (x @ A.T) @ B_scaled.T.
    # B_scaled is the transpose of a contiguous [r, out_features] block, the layout the device tier stores
    # (engine/lora/device_tier.py), so bringing an adapter onto the device copies it without transposing.
    layers: tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], ...] = field(hash=False, compare=False)
    nbytes: int
    # A DoRA adapter's [num_layers] of {module: m [out_features] fp32}, the module's rows of its saved magnitude (the
    # device tier turns m into the row scales over the base's weights, engine/lora/dora.py); () without DoRA.
    magnitudes: tuple[dict[str, torch.Tensor], ...] = field(default=(), hash=False, compare=False)
    # LoRA on the embedding and the LM head, {module: its two tensors} in engine/lora/vocab_lora.py's device layout
    vocab: VocabWeights = field(default_factory=dict, hash=False, compare=False)


def _tensor_key(layer: int, name: str, part: str) -> str:
    """The PEFT key of lora_A or lora_B of the checkpoint projection `name` (`checkpoint_modules`)."""
    return f"base_model.model.{module_name(layer, name)}.lora_{part}.weight"


# ---- the adapter directory -------------------------------------------------------------------------


def resolve_inside(root: Path, given: str) -> Path:
    """The real path of `root/given` (symlinks resolved), or AdapterError naming `path` when it is not
    strictly inside root's real path. Resolving before checking means that neither `..`, an absolute
    path nor a symlink can lead outside `root`: the one rule for adapters found at startup and for
    POST /v1/adapters."""
    real_root = Path(os.path.realpath(root))
    try:
        real = Path(os.path.realpath(real_root / given))  # an absolute `given` replaces the root here
    except (ValueError, OSError) as exc:  # e.g. an embedded NUL byte
        raise AdapterError(f"path: unusable ({exc})") from None
    if real == real_root or not real.is_relative_to(real_root):
        raise AdapterError(
            f"path: {given[:200]!r} is not inside the engine's --adapter-dir; "
            "give a subdirectory of it, relative to it (symlinks must stay inside it too)"
        )
    return real


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
        raise AdapterError(f"adapter {adapter_id!r}: {name} is a symlink pointing outside the adapter directory")
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


# ---- the safetensors file ----------------------------------------------------------------------------


def _read_header(adapter_id: str, file: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """{tensor name: (shape, safetensors dtype)}, from the header only."""
    try:
        with safe_open(file, framework="pt") as f:
            slices = {key: f.get_slice(key) for key in f.keys()}
            return {key: (tuple(piece.get_shape()), piece.get_dtype()) for key, piece in slices.items()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterError(f"adapter {adapter_id!r}: {WEIGHTS_FILE} is not a valid safetensors file ({exc})") from None


def _check_tensors(
    adapter_id: str,
    header: dict[str, tuple[tuple[int, ...], str]],
    layers: tuple[dict[str, LoraTarget], ...],
    model: ModelConfig,
) -> None:
    """The file holds exactly an A and a B of the right shape and a float dtype for every planned pair."""
    found: set[tuple[int, str]] = set()
    unknown = []
    covered = checkpoint_modules(model)
    for key, (_, dtype) in header.items():
        m = _KEY_RE.fullmatch(key)
        if (
            m is None
            or m[3] not in covered
            or (m[2] == "self_attn") != (m[3] in ATTENTION_MODULES)
            or int(m[1]) >= model.num_layers
        ):
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
    for layer, name in sorted(found):
        if covered[name][0] not in layers[layer]:
            raise AdapterError(
                f"adapter {adapter_id!r} has weights for {module_name(layer, name)}, "
                "which its adapter_config.json does not target"
            )
    for layer, by_module in enumerate(layers):
        for name, modules in covered.items():
            if modules[0] not in by_module:
                continue
            rank = by_module[modules[0]].rank
            for part, expected in _expected_shapes(model, name, rank):
                key = _tensor_key(layer, name, part)
                if key not in header:
                    raise AdapterError(
                        f"adapter {adapter_id!r}: {WEIGHTS_FILE} lacks {key}, "
                        f"but adapter_config.json targets {module_name(layer, name)}"
                    )
                _check_shape(adapter_id, key, header[key][0], expected, rank)


def _expected_shapes(model: ModelConfig, name: str, rank: int) -> tuple[tuple[str, tuple[int, int]], ...]:
    """The shapes of lora_A and lora_B of the checkpoint projection `name`: B spans the modules it covers."""
    modules = checkpoint_modules(model)[name]
    in_features = module_features(model, modules[0])[0]
    out_features = sum(module_features(model, module)[1] for module in modules)
    return ("A", (rank, in_features)), ("B", (out_features, rank))


def _check_shape(adapter_id: str, key: str, shape: tuple[int, ...], expected: tuple[int, int], rank: int) -> None:
    if tuple(shape) != expected:
        raise AdapterError(
            f"adapter {adapter_id!r}: tensor {key} has shape {list(shape)}, expected {list(expected)} (rank "
            f"{rank} from adapter_config.json, features from the base model); "
            "was it trained on another model?"
        )


def read_adapter(
    path: Path, adapter_id: str, version: int, model: ModelConfig, base: BaseVocab | None = None
) -> AdapterSpec:
    """Validate an adapter directory from its config and safetensors header (no tensor data is read, but copies of the
    base's embedding or LM head that PEFT saved beside a LoRA on them, compared with the base's own: `base`, the
    served model's digests of them; an adapter with such copies is refused without it)."""
    validate_adapter_id(adapter_id)
    root = _adapter_dir(adapter_id, path)
    cfg = parse_config(adapter_id, _read_config(adapter_id, root))
    weights_file = _weights_file(adapter_id, root)
    layers = plan_targets(adapter_id, cfg, model)
    vocab = plan_vocab(adapter_id, cfg, model)
    header = _check_magnitudes(adapter_id, _read_header(adapter_id, weights_file), layers, model, cfg.dora)
    # the embedding's and LM head's tensors, and any copies of the base's matrices (read and compared here)
    header = check_vocab_file(adapter_id, weights_file, header, vocab, model, base)
    _check_tensors(adapter_id, header, layers, model)
    ranks = [t.rank for by_module in layers for t in by_module.values()] + [t.rank for t in vocab.targets.values()]
    num_params = sum(
        target.rank * sum(module_features(model, module))
        for by_module in layers
        for module, target in by_module.items()
    )
    if cfg.dora:  # a magnitude per output feature of every targeted module
        num_params += sum(module_features(model, module)[1] for by_module in layers for module in by_module)
    num_params += vocab_params(vocab, model)
    return AdapterSpec(
        adapter_id=adapter_id,
        version=version,
        path=root,
        layers=layers,
        modules=tuple(m for m in MODULES if any(m in by_module for by_module in layers)),
        max_rank=max(ranks),
        num_params=num_params,
        nbytes=4 * num_params,
        stamp=_stamp(weights_file),
        dora=cfg.dora,
        vocab_modules=tuple(vocab.targets),
        vocab_targets=vocab.targets,
        tied_head=vocab.tied_head,
    )


def load_weights(spec: AdapterSpec, model: ModelConfig, dtype: torch.dtype) -> LoraWeights:
    """Read an adapter's A and B (scale folded into B) as contiguous CPU tensors of `dtype`."""
    if not dtype.is_floating_point:
        raise ValueError(f"adapter weights need a floating dtype, got {dtype}")
    if len(spec.layers) != model.num_layers:
        raise ValueError(f"spec of adapter {spec.adapter_id!r} was read for a {len(spec.layers)}-layer model")
    weights_file = _weights_file(spec.adapter_id, spec.path)
    if _stamp(weights_file) != spec.stamp:
        raise AdapterError(
            f"adapter {spec.adapter_id!r}: {WEIGHTS_FILE} changed on disk since version "
            f"{spec.version} was registered; register it again"
        )
    layers: tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], ...] = tuple({} for _ in spec.layers)
    # One buffer for the whole adapter, each tensor converted straight into its slice (always a copy: safetensors
    # may hand out tensors backed by an mmap of the file, which a later overwrite would change under the cache),
    # B scaled in fp32 and rounded once, and one finiteness check over all of it: one op per tensor where a copy, a
    # scale, a cast and an isfinite mask were one each (a 30-layer adapter has hundreds of small tensors, and its
    # first request waits for them: ~70 -> ~35 ms a W1 adapter).
    try:
        with safe_open(weights_file, framework="pt", device="cpu") as f:
            read = []
            tensors: dict[str, torch.Tensor] = {}  # a fused projection's A and B serve each module it covers

            def tensor(layer: int, name: str, part: str, shape: tuple[int, int], rank: int) -> torch.Tensor:
                key = _tensor_key(layer, name, part)
                if key not in tensors:
                    tensors[key] = _read_tensor(spec.adapter_id, f, key, shape, rank)
                return tensors[key]

            for layer, module, target in spec.targets():
                name, first_row = checkpoint_module(model, module)
                (_, a_shape), (_, b_shape) = _expected_shapes(model, name, target.rank)
                a = tensor(layer, name, "A", a_shape, target.rank)
                b = tensor(layer, name, "B", b_shape, target.rank)
                b = b[first_row : first_row + module_features(model, module)[1]]  # the module's rows of B
                read.append((layer, module, target.scale, a, b))
            flat = torch.empty(sum(a.numel() + b.numel() for *_, a, b in read), dtype=dtype)
            offset = 0
            for layer, module, scale, a, b in read:
                a_out = flat[offset : offset + a.numel()].view(a.shape)
                offset += a.numel()
                b_out = flat[offset : offset + b.numel()].view(b.shape[1], b.shape[0]).t()  # see LoraWeights
                offset += b.numel()
                a_out.copy_(a)
                torch.mul(b.float(), scale, out=b_out)
                layers[layer][module] = (a_out, b_out)
            magnitudes = _read_magnitudes(spec, model, f) if spec.dora else ()
            vocab = read_vocab_weights(spec.adapter_id, f, spec, model, dtype) if spec.vocab_targets else {}
    except (SafetensorError, OSError) as exc:
        raise AdapterError(f"adapter {spec.adapter_id!r}: cannot read {WEIGHTS_FILE} ({exc})") from None
    # NaN and inf both reach the minimum or the maximum: one reduction, where isfinite(flat).all() makes a mask
    if flat.numel() and not all(bool(torch.isfinite(v)) for v in torch.aminmax(flat)):
        _raise_non_finite(spec, layers, dtype)
    magnitude_bytes = 4 * sum(m.numel() for by_module in magnitudes for m in by_module.values())
    vocab_bytes = sum(t.numel() * t.element_size() for pair in vocab.values() for t in pair)
    return LoraWeights(
        spec=spec,
        layers=layers,
        nbytes=flat.numel() * flat.element_size() + magnitude_bytes + vocab_bytes,
        magnitudes=magnitudes,
        vocab=vocab,
    )


def _magnitude_key(layer: int, name: str) -> str:
    """The PEFT key of DoRA's magnitude of the checkpoint projection `name`."""
    return f"base_model.model.{module_name(layer, name)}{_MAGNITUDE_SUFFIX}"


def _checkpoint_rows(model: ModelConfig, name: str) -> int:
    """The output features of the checkpoint projection `name`: a fused one's span the modules it covers."""
    return sum(module_features(model, module)[1] for module in checkpoint_modules(model)[name])


def _check_magnitudes(
    adapter_id: str,
    header: dict[str, tuple[tuple[int, ...], str]],
    layers: tuple[dict[str, LoraTarget], ...],
    model: ModelConfig,
    dora: bool,
) -> dict[str, tuple[tuple[int, ...], str]]:
    """DoRA's magnitudes in the header: with use_dora exactly one float [out_features] vector per targeted checkpoint
    projection, without it none. Returns the header less them, for `_check_tensors`."""
    found = sorted(key for key in header if key.endswith(_MAGNITUDE_SUFFIX))
    if found and not dora:
        raise AdapterError(
            f"adapter {adapter_id!r}: {WEIGHTS_FILE} holds DoRA magnitudes (e.g. {found[0]}), but adapter_config.json "
            "does not set use_dora"
        )
    expected = {
        _magnitude_key(layer, name): name
        for layer, by_module in enumerate(layers)
        for name, covered in checkpoint_modules(model).items()
        if dora and covered[0] in by_module
    }
    for key in found:
        if key not in expected:
            raise AdapterError(
                f"adapter {adapter_id!r}: {WEIGHTS_FILE} holds {key}, a DoRA magnitude of no projection "
                "its adapter_config.json targets (loragate applies DoRA to the decoder layers' projections only)"
            )
        shape, dtype = header[key]
        if dtype not in _FLOAT_DTYPES:
            raise AdapterError(f"adapter {adapter_id!r}: tensor {key} has dtype {dtype}, not a float type")
        _check_magnitude_shape(adapter_id, key, shape, _checkpoint_rows(model, expected[key]))
    missing = sorted(expected.keys() - header.keys())
    if missing:
        raise AdapterError(
            f"adapter {adapter_id!r}: {WEIGHTS_FILE} lacks {missing[0]}, but adapter_config.json sets use_dora: "
            "DoRA needs a magnitude for every module it targets"
        )
    return {key: value for key, value in header.items() if not key.endswith(_MAGNITUDE_SUFFIX)}


def _check_magnitude_shape(adapter_id: str, key: str, shape: tuple[int, ...], rows: int) -> None:
    if tuple(shape) != (rows,):
        raise AdapterError(
            f"adapter {adapter_id!r}: tensor {key} has shape {list(shape)}, expected [{rows}] (one magnitude per "
            "output feature of the base model's projection); was it trained on another model?"
        )


def _read_magnitudes(spec: AdapterSpec, model: ModelConfig, f: Any) -> tuple[dict[str, torch.Tensor], ...]:
    """Each targeted module's rows of its projection's DoRA magnitude, fp32 (a copy, as the weights are: safetensors
    may hand out views of an mmap), checked finite: AdapterError naming the tensor otherwise."""
    magnitudes: tuple[dict[str, torch.Tensor], ...] = tuple({} for _ in spec.layers)
    read: dict[str, torch.Tensor] = {}  # a fused projection's magnitude serves each module it covers
    for layer, module, _ in spec.targets():
        name, first_row = checkpoint_module(model, module)
        key = _magnitude_key(layer, name)
        if key not in read:
            tensor = f.get_tensor(key)  # the file may have been replaced with a same-stamp one: check again
            _check_magnitude_shape(spec.adapter_id, key, tuple(tensor.shape), _checkpoint_rows(model, name))
            read[key] = tensor.to(torch.float32, copy=True)
            if not bool(torch.isfinite(read[key]).all()):
                raise AdapterError(f"adapter {spec.adapter_id!r}: {key} has non-finite values (NaN or inf) in float32")
        magnitudes[layer][module] = read[key][first_row : first_row + module_features(model, module)[1]]
    return magnitudes


def _read_tensor(adapter_id: str, f: Any, key: str, shape: tuple[int, int], rank: int) -> torch.Tensor:
    tensor = f.get_tensor(key)  # the file may have been replaced with a same-stamp one: check again
    _check_shape(adapter_id, key, tuple(tensor.shape), shape, rank)
    return tensor


def _raise_non_finite(
    spec: AdapterSpec, layers: tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], ...], dtype: torch.dtype
) -> None:
    """The AdapterError naming the first tensor with a NaN or inf (as read, or after the cast to `dtype`)."""
    in_dtype = "" if dtype == torch.float32 else f" in {dtype}"
    for layer, by_module in enumerate(layers):
        for module, pair in by_module.items():
            for part, tensor in zip("AB", pair, strict=True):
                if not bool(torch.isfinite(tensor).all()):
                    raise AdapterError(
                        f"adapter {spec.adapter_id!r}: lora_{part} of {module_name(layer, module)} has "
                        f"non-finite values (NaN or inf){in_dtype}"
                    )
    raise AdapterError(f"adapter {spec.adapter_id!r}: non-finite values (NaN or inf){in_dtype}")
