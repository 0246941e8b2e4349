"""LoRA on the embedding (`embed_tokens`) and the LM head (`lm_head`): their tensors in an adapter file, the copies of
the base's own matrices a PEFT adapter carries beside them, and their weights on the device per adapter slot.

What PEFT computes (0.21, peft/tuners/lora/layer.py; engine/lora/peft_config.py `plan_vocab` says which modules):
- embed_tokens (`Embedding`): lora_embedding_A [r, vocab] and lora_embedding_B [hidden, r]; token t's delta is
  s * B @ A[:, t], added to the embedding after the base's own scale and multiplied by it too (Gemma 3's sqrt(hidden):
  PEFT scales the delta by the base layer's `embed_scale`).
- lm_head (`Linear`): a linear LoRA whose B is as wide as the vocabulary: logits += s * (x @ A.T) @ B.T.
- A tied head (ensure_weight_tying on a base with tied embeddings) is the embedding's LoRA transposed: A = B_emb.T,
  B = A_emb.T, with the head's own scale. PEFT saves the head's tensors too and loads them into the same storage as
  the embedding's, so the file's must equal the embedding's transposes (refused otherwise: which would win is
  PEFT's load order).

save_embedding_layers="auto" (peft/utils/save_and_load.py) saves the whole embedding and head matrices beside such a
LoRA (`...embed_tokens.base_layer.weight`, `lm_head.base_layer.weight`; `...embed_tokens.weight` and `lm_head.weight`
when a resized vocabulary made it save untargeted ones). loragate serves every adapter over the base's own matrices:
a copy is accepted where it equals them as the engine serves them (`BaseVocab`) and refused where it does not.

On the device (`VocabSlots`): these weights are not per layer, so they do not fit the page pool's per-layer slot
regions (engine/lora/device_tier.py); each slot's are separate tensors of the pool's device and dtype, written when
the tier writes the slot and dropped when it clears it: the embedding's A as a [vocab, r] table (a lookup is an
index_select) and its scale-folded B [r, hidden], the head's A [r, hidden] and scale-folded B [vocab, r]. They are
counted in the tier's memory as `VocabSlots.nbytes`, beside the pool and not in its pages (2 * vocab * r elements an
adapter and module: SmolLM2 at r=16 is 3 MiB in fp32), at most one set per device slot.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.lora.peft_config import VOCAB_MODULES, AdapterError, AdapterSpec, VocabPlan
from engine.model.config import ModelConfig

# (module, part) -> the key PEFT saves the LoRA tensor under
LORA_KEYS: dict[tuple[str, str], str] = {
    ("embed_tokens", "A"): "base_model.model.model.embed_tokens.lora_embedding_A",
    ("embed_tokens", "B"): "base_model.model.model.embed_tokens.lora_embedding_B",
    ("lm_head", "A"): "base_model.model.lm_head.lora_A.weight",
    ("lm_head", "B"): "base_model.model.lm_head.lora_B.weight",
}
# a saved copy of a base matrix -> its module
COPY_KEYS: dict[str, str] = {
    "base_model.model.model.embed_tokens.base_layer.weight": "embed_tokens",
    "base_model.model.model.embed_tokens.weight": "embed_tokens",
    "base_model.model.lm_head.base_layer.weight": "lm_head",
    "base_model.model.lm_head.weight": "lm_head",
}
_FLOAT_DTYPES = frozenset(("F16", "BF16", "F32", "F64"))
_WHAT = {"embed_tokens": "embeddings", "lm_head": "LM head"}

Header = dict[str, tuple[tuple[int, ...], str]]  # tensor name -> (shape, safetensors dtype)
VocabWeights = dict[str, tuple[torch.Tensor, torch.Tensor]]  # module -> its two device-layout tensors (see above)


# ---- the adapter file ---------------------------------------------------------------------------------


def lora_shapes(module: str, rank: int, model: ModelConfig) -> dict[str, tuple[int, int]]:
    """The shapes of the module's LoRA tensors as PEFT saves them, by part."""
    vocab, hidden = model.vocab_size, model.hidden_size
    if module == "embed_tokens":
        return {"A": (rank, vocab), "B": (hidden, rank)}
    return {"A": (rank, hidden), "B": (vocab, rank)}


def check_vocab_file(
    adapter_id: str, file: Path, header: Header, plan: VocabPlan, model: ModelConfig, base: BaseVocab | None
) -> Header:
    """Check the header's embedding and LM-head tensors (a LoRA tensor for every planned module, none for another,
    shapes, float dtypes) and that every saved copy of a base matrix equals the base's (read from `file`, compared
    with `base`, the served model's `BaseVocab`; without one a copy is refused); returns the rest of the header.
    AdapterError names the tensor and what is wrong."""
    mine = {key: entry for key, entry in header.items() if key in COPY_KEYS or key in _LORA_MODULE}
    for key, (_, dtype) in mine.items():
        if dtype not in _FLOAT_DTYPES:
            raise AdapterError(f"adapter {adapter_id!r}: tensor {key} has dtype {dtype}, not a float type")
    for (module, part), key in LORA_KEYS.items():
        target = plan.targets.get(module)
        optional = plan.tied_head and module == "lm_head"  # the embedding's, transposed: PEFT saves it anyway
        if target is None:
            if key in mine:
                raise AdapterError(
                    f"adapter {adapter_id!r} has weights for {VOCAB_MODULES[module]} ({key}), "
                    "which its adapter_config.json does not target"
                )
        elif key in mine or not optional:
            if key not in mine:
                raise AdapterError(
                    f"adapter {adapter_id!r}: the weights file lacks {key}, "
                    f"but adapter_config.json targets {VOCAB_MODULES[module]}"
                )
            _check_shape(adapter_id, key, mine[key][0], lora_shapes(module, target.rank, model)[part], model)
    copies = [key for key in mine if key in COPY_KEYS]
    for key in copies:
        _check_copy_shape(adapter_id, key, mine[key][0], model)
    if copies:
        _compare_copies(adapter_id, file, copies, base)
    return {key: entry for key, entry in header.items() if key not in mine}


_LORA_MODULE = {key: module for (module, _), key in LORA_KEYS.items()}


def _check_shape(
    adapter_id: str, key: str, shape: tuple[int, ...], expected: tuple[int, int], model: ModelConfig
) -> None:
    if tuple(shape) == expected:
        return
    differ = [i for i in range(len(shape)) if len(shape) == 2 and shape[i] != expected[i]]
    resized = ""
    if len(differ) == 1 and expected[differ[0]] == model.vocab_size:
        resized = f": {shape[differ[0]]} tokens where the base has {model.vocab_size} (a resized vocabulary?)"
    raise AdapterError(
        f"adapter {adapter_id!r}: tensor {key} has shape {list(shape)}, expected {list(expected)} (rank from "
        f"adapter_config.json, vocabulary and hidden size from the base model){resized}"
    )


def _check_copy_shape(adapter_id: str, key: str, shape: tuple[int, ...], model: ModelConfig) -> None:
    expected = (model.vocab_size, model.hidden_size)
    if tuple(shape) != expected:
        raise AdapterError(
            f"{_differs(adapter_id, COPY_KEYS[key])}: {key} has shape {list(shape)}, the base's is {list(expected)}"
        )


def _differs(adapter_id: str, module: str) -> str:
    return (
        f"adapter {adapter_id!r}: the adapter carries its own {module} weights (a resized vocabulary?) which differ "
        f"from the base model's; loragate serves adapters over the base's own {_WHAT[module]}"
    )


def _compare_copies(adapter_id: str, file: Path, keys: list[str], base: BaseVocab | None) -> None:
    if base is None:
        raise AdapterError(
            f"adapter {adapter_id!r} carries copies of the base's {' and '.join(sorted({COPY_KEYS[k] for k in keys}))} "
            "weights, and no loaded base model is at hand to compare them with"
        )
    with safe_open(file, framework="pt", device="cpu") as f:
        for key in keys:
            rows = base.first_difference(COPY_KEYS[key], f.get_tensor(key))
            if rows is not None:
                raise AdapterError(
                    f"{_differs(adapter_id, COPY_KEYS[key])}: {key} differs from it in rows {rows[0]}..{rows[1] - 1}"
                )


def read_vocab_weights(
    adapter_id: str, f: Any, spec: AdapterSpec, model: ModelConfig, dtype: torch.dtype
) -> VocabWeights:
    """The adapter's embedding and LM-head LoRA from an open safetensors file `f`, in the device layout (see the
    module docstring) and `dtype`, the scale folded into B in fp32 and rounded once. AdapterError names a tensor that
    is not finite (as read or in `dtype`), and a tied head whose saved tensors are not the embedding's."""
    raw: dict[str, dict[str, torch.Tensor]] = {}
    for module, target in spec.vocab_targets.items():
        if module == "lm_head" and spec.tied_head:
            continue
        raw[module] = {}
        for part, shape in lora_shapes(module, target.rank, model).items():
            tensor = f.get_tensor(LORA_KEYS[(module, part)])  # the file may have been replaced: check again
            _check_shape(adapter_id, LORA_KEYS[(module, part)], tuple(tensor.shape), shape, model)
            _check_finite(adapter_id, module, part, tensor.float(), "")
            raw[module][part] = tensor
    if spec.tied_head:
        raw["lm_head"] = _tied_head(adapter_id, f, raw["embed_tokens"])
    out: VocabWeights = {}
    for module, parts in raw.items():
        scale = spec.vocab_targets[module].scale
        a, b = parts["A"], (parts["B"].float() * scale)
        if module == "embed_tokens":  # the table [vocab, r] and B_scaled.T [r, hidden]
            pair = (a.t().to(dtype).contiguous(), b.t().to(dtype).contiguous())
        else:  # A [r, hidden] and B_scaled [vocab, r]
            pair = (a.to(dtype).contiguous(), b.to(dtype).contiguous())
        in_dtype = "" if dtype == torch.float32 else f" in {dtype}"
        for part, tensor in zip("AB", pair, strict=True):
            _check_finite(adapter_id, module, part, tensor, in_dtype)
        out[module] = pair
    return out


def _tied_head(adapter_id: str, f: Any, embedding: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    head = {"A": embedding["B"].t(), "B": embedding["A"].t()}
    for part, tensor in head.items():
        key = LORA_KEYS[("lm_head", part)]
        if key in f.keys() and not torch.equal(f.get_tensor(key), tensor):
            raise AdapterError(
                f"adapter {adapter_id!r}: ensure_weight_tying ties lm_head's LoRA to embed_tokens', but {key} is not "
                f"the transpose of embed_tokens' lora_embedding_{'B' if part == 'A' else 'A'}"
            )
    return head


def _check_finite(adapter_id: str, module: str, part: str, tensor: torch.Tensor, in_dtype: str) -> None:
    if tensor.numel() and not all(bool(torch.isfinite(v)) for v in torch.aminmax(tensor)):
        name = f"lora_embedding_{part}" if module == "embed_tokens" else f"lora_{part}"
        raise AdapterError(
            f"adapter {adapter_id!r}: {name} of {VOCAB_MODULES[module]} has non-finite values (NaN or inf){in_dtype}"
        )


def vocab_params(plan: VocabPlan, model: ModelConfig) -> int:
    """Parameters of the planned embedding and LM-head LoRAs (a tied head's count: the engine keeps its own copy)."""
    return sum(target.rank * (model.vocab_size + model.hidden_size) for target in plan.targets.values())


# ---- the base's matrices, as saved copies are compared with them -------------------------------------------

DIGEST_ROWS = 256  # rows per digest
_CAST_ROWS = 64 * DIGEST_ROWS
_WORDS = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # a float dtype's bits, by element size


class BaseVocab:
    """Digests of the base's embedding and LM head: a sha256 per block of DIGEST_ROWS rows, of the rows' bytes in a
    given dtype (equal rows, equal digests, on any device and thread count).

    A saved copy equals the base where every block's digest does, both taken in the coarser of the copy's dtype and
    the dtype the engine serves the matrix in (a bf16 copy of an fp32 base is compared rounded to bf16, an fp32 copy
    of a bf16-served base rounded to bf16): equal as the engine would serve it. The digests are taken from the model's
    plain matrices (`source`) on first need, or all at once by `capture` before the model lays its GEMMs' weights out
    and drops the plain ones (engine/model/decoder.py CausalLM.prepack): in the served dtype and each coarser float
    dtype a copy may come in (SmolLM2's tied fp32 embeddings, 28M weights: under half a second on two cores)."""

    def __init__(self, source: Callable[[], dict[str, torch.Tensor] | None]) -> None:
        self._source: Callable[[], dict[str, torch.Tensor] | None] | None = source
        self._served: dict[str, torch.dtype] = {}
        self._digests: dict[tuple[str, torch.dtype], list[bytes]] = {}
        self._lock = threading.Lock()  # copies are checked on adapter threads

    def capture(self) -> None:
        """Take every digest now; the source is not read again."""
        with self._lock:
            if self._source is None:  # taken already
                return
            matrices = self._matrices()
            for module, matrix in matrices.items():
                self._served[module] = matrix.dtype
                coarser = [d for d in (torch.bfloat16, torch.float16) if _eps(d) > _eps(matrix.dtype)]
                for dtype in [matrix.dtype, *coarser]:
                    self._base_digests(module, dtype, matrices)
            self._source = None

    def first_difference(self, module: str, copy: torch.Tensor) -> tuple[int, int] | None:
        """The first block of rows [lo, hi) in which `copy` [vocab, hidden] differs from the base's `module` matrix,
        None if none does."""
        with self._lock:
            matrices = None if self._source is None else self._matrices()
            served = self._served[module] if matrices is None else matrices[module].dtype
            dtype = copy.dtype if _eps(copy.dtype) > _eps(served) else served
            base = self._base_digests(module, dtype, matrices)
        for block, (mine, theirs) in enumerate(zip(digests(copy, dtype), base, strict=True)):
            if mine != theirs:
                return block * DIGEST_ROWS, min((block + 1) * DIGEST_ROWS, copy.shape[0])
        return None

    def _matrices(self) -> dict[str, torch.Tensor]:
        matrices = None if self._source is None else self._source()
        if matrices is None:
            raise RuntimeError("the base model's plain embedding and head are gone before their digests were taken")
        return matrices

    def _base_digests(self, module: str, dtype: torch.dtype, matrices: dict[str, torch.Tensor] | None) -> list[bytes]:
        key = (module, dtype)
        if key not in self._digests:
            if matrices is None:
                raise RuntimeError(f"no digest of the base's {module} in {dtype} was taken")
            tied = [m for m, matrix in matrices.items() if matrix is matrices[module] and (m, dtype) in self._digests]
            self._digests[key] = self._digests[(tied[0], dtype)] if tied else digests(matrices[module], dtype)
        return self._digests[key]


def digests(matrix: torch.Tensor, dtype: torch.dtype) -> list[bytes]:
    """The sha256 of each block of DIGEST_ROWS rows of `matrix` rounded to `dtype`."""
    out = []
    for lo in range(0, matrix.shape[0], _CAST_ROWS):  # cast in large pieces, hash in blocks
        piece = matrix[lo : lo + _CAST_ROWS].detach().to("cpu", dtype).contiguous()
        words = piece.view(_WORDS[piece.element_size()]).numpy()
        out += [
            hashlib.sha256(words[i : i + DIGEST_ROWS].tobytes()).digest() for i in range(0, len(words), DIGEST_ROWS)
        ]
    return out


def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


# ---- the device side: each slot's weights, and a step's use of them --------------------------------------------


@dataclass(frozen=True, slots=True)
class SlotVocab:
    embed: tuple[torch.Tensor, torch.Tensor] | None  # (A table [vocab, r], B_scaled [r, hidden])
    head: tuple[torch.Tensor, torch.Tensor] | None  # (A [r, hidden], B_scaled [vocab, r])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in (self.embed, self.head) if pair for t in pair)


class VocabSlots:
    """The embedding and LM-head LoRA weights of the device tier's slots (engine/lora/device_tier.py writes and clears
    them with the slot). `active` counts the slots holding any: while it is 0 a step costs one comparison."""

    def __init__(self, num_slots: int, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self._slots: list[SlotVocab | None] = [None] * num_slots
        self.active = 0
        self.nbytes = 0

    def write(self, slot: int, vocab: VocabWeights) -> None:
        """Hold `vocab` (engine/lora/files.py LoraWeights.vocab, on the host) for `slot`, replacing what it held."""
        self.clear(slot)
        if not vocab:
            return
        entry = SlotVocab(self._placed(vocab.get("embed_tokens")), self._placed(vocab.get("lm_head")))
        self._slots[slot] = entry
        self.active += 1
        self.nbytes += entry.nbytes

    def clear(self, slot: int) -> None:
        entry = self._slots[slot]
        if entry is not None:
            self._slots[slot] = None
            self.active -= 1
            self.nbytes -= entry.nbytes

    def _placed(self, pair: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        if pair is None:
            return None
        a, b = (t.to(self.device, self.dtype) for t in pair)
        return a, b

    def step(self, slots: list[int | None], num_tokens: list[int]) -> VocabStep | None:
        """What a step of requests (their slots and token counts, in batch order) needs: the row ranges whose slot has
        an embedding LoRA, and the slots with a head LoRA; None when no row has either."""
        embeds: list[tuple[int, int, tuple[torch.Tensor, torch.Tensor]]] = []
        heads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        row = 0
        for slot, n in zip(slots, num_tokens, strict=True):
            entry = None if slot is None else self._slots[slot]
            if slot is not None and entry is not None:
                if entry.embed is not None:
                    if embeds and embeds[-1][1] == row and embeds[-1][2] is entry.embed:
                        embeds[-1] = (embeds[-1][0], row + n, entry.embed)
                    else:
                        embeds.append((row, row + n, entry.embed))
                if entry.head is not None:
                    heads[slot] = entry.head
            row += n
        return VocabStep(embeds, heads) if embeds or heads else None


@dataclass(slots=True)
class VocabStep:
    """A step's embedding and LM-head LoRA (`VocabSlots.step`)."""

    embeds: list[tuple[int, int, tuple[torch.Tensor, torch.Tensor]]]  # rows [start, end) and their (A table, B)
    heads: dict[int, tuple[torch.Tensor, torch.Tensor]]  # slot -> (A, B_scaled)

    def embed(self, input_ids: torch.Tensor, h: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """h [T, hidden] (the step's embeddings, after the base's scale) plus each row's embedding LoRA: its token's
        row of A's table times B (the scale folded in), times the base's `scale` where it has one."""
        for start, end, (table, b) in self.embeds:
            delta = table.index_select(0, input_ids[start:end]) @ b  # [n, hidden]
            if scale is not None:
                delta = delta * scale
            h[start:end] += delta.to(h.dtype)
        return h

    def head(self, logits: torch.Tensor, hidden: torch.Tensor, row_slots: list[int | None]) -> None:
        """logits [N, vocab] += each row's head LoRA, (hidden @ A.T) @ B.T, for the rows whose slot (`row_slots`,
        the device slot of each row's adapter, None for the base) has one."""
        rows: dict[int, list[int]] = {}
        for i, slot in enumerate(row_slots):
            if slot is not None and slot in self.heads:
                rows.setdefault(slot, []).append(i)
        for slot, chosen in rows.items():
            a, b = self.heads[slot]
            if len(chosen) == logits.shape[0]:
                logits += ((hidden.to(a.dtype) @ a.t()) @ b.t()).to(logits.dtype)
                continue
            index = torch.tensor(chosen, device=logits.device)
            delta = (hidden.index_select(0, index).to(a.dtype) @ a.t()) @ b.t()
            logits.index_add_(0, index, delta.to(logits.dtype))
