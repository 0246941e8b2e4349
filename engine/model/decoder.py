"""Our own decoder forward pass (every family engine/model/config.py serves) over a flat token batch and a paged KV
cache.

No padding: a step is one flat batch of T tokens from many sequences, `[T, hidden]` through every
linear layer. Each layer runs four projections as separate, named steps (qkv_proj, o_proj,
gate_up_proj, down_proj) so per-request LoRA deltas can be added to their outputs (`y += lora(x)`, one
call per fused projection: the group's modules share their input). q/k/v and gate/up are fused at load time (fewer
matmuls: measured faster on CPU).
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.lora.dora import row_norms
from engine.lora.vocab_lora import BaseVocab
from engine.model.attention import AttentionMetadata, AttentionPlan, paged_attention, plan_attention
from engine.model.cpu_gemm import PackedLinear, PanelEmbedding, packed_linear, prepack_linears
from engine.model.head_screen import HeadScreen
from engine.model.layer_ops import LAYER_OPS, LayerOps, TorchLayerOps
from loragate_kernels.backends import Backends, Gemm

if TYPE_CHECKING:
    from engine.model.config import ModelConfig


class StepInterrupted(Exception):
    """The forward pass stopped between two layers because its `interrupt` event was set. The layers before wrote
    the K/V of this step's tokens into their slots; computing the same tokens again writes the same values, so the
    step can simply be scheduled again (engine/core/llm_engine.py: a critical arrival interrupts lower-class work)."""


class LayerLoraDelta(Protocol):
    """One layer's LoRA deltas for a step: `linear` computes a projection with them added."""

    def linear(self, group: str, proj: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """proj(x) [T, out] (a fused projection's output) plus the deltas of the group's modules for x [T, in].

        Groups (engine/lora/peft_config.py GROUPS) follow the fused projections: "qkv" (q|k|v columns),
        "o", "gate_up" (gate|up columns), "down"."""


class LoraDelta(Protocol):
    """All the LoRA the model sees of a step (engine/lora/routes.py's LoraBatch implements it)."""

    def layer(self, index: int) -> LayerLoraDelta: ...

    def embed(self, input_ids: torch.Tensor, h: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """h [T, hidden] (the embeddings of input_ids [T], already times the base's `scale` where it has one) plus
        each row's embedding LoRA, times `scale` too (as PEFT scales it); may add in place."""


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return TorchLayerOps.norm(x, self.weight, self.eps)


def rope_inv_freq(config: ModelConfig, rope: dict[str, Any], long: bool = False) -> torch.Tensor:
    """[rotary_dim // 2] fp32 inverse frequencies of one kind of layer (`rope`: one of config.rope_parameters), with
    its scaling applied; `long` picks longrope's long factors (positions past the original context)."""
    dim = rotary_dim(config, rope)
    # on the CPU explicitly: the model is built under torch.device("meta") (engine/model/loader.py)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (float(rope["rope_theta"]) ** exponents)
    kind = rope["rope_type"]
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / rope["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, rope, config.max_position_embeddings)
    if kind == "longrope":
        factors = torch.tensor(rope["long_factor" if long else "short_factor"], dtype=torch.float32, device="cpu")
        if factors.shape != inv_freq.shape:
            raise ValueError(f"longrope factors have {factors.numel()} entries, {inv_freq.numel()} rotary pairs need")
        return inv_freq / factors
    raise ValueError(f"unsupported rope_type {kind!r}")


def rotary_dim(config: ModelConfig, rope: dict[str, Any]) -> int:
    """How many of a head's dims rotate (the first ones; Phi-4-mini rotates 3/4 of them)."""
    return int(config.head_dim * rope.get("partial_rotary_factor", 1.0))


def _longrope_scaling(config: ModelConfig, rope: dict[str, Any]) -> tuple[int, float]:
    """(the original context length, the factor cos and sin are multiplied by) of a longrope config, as
    transformers computes them."""
    original = int(rope.get("original_max_position_embeddings") or config.max_position_embeddings)
    factor = rope.get("factor") or config.max_position_embeddings / original
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return original, float(attention)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict, max_positions: int) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths slowed by `factor`, short kept, a smooth blend between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling.get("original_max_position_embeddings", max_positions)
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, out)


class RotaryEmbedding(nn.Module):
    """cos/sin tables of one kind of layer for every position up to max_position_embeddings, indexed per token.

    HF's convention: the rotation pairs dim i with dim i + rotary_dim/2 (rotate_half) over the head's first rotary_dim
    dims; the rest pass through. We fold the sign of rotate_half into `sin` so applying it is
    x * cos + roll(x, rotary_dim/2) * sin on those dims.

    longrope: positions before the original context use the short factors and later ones the long factors, each
    position its own (transformers switches a whole forward pass to the long factors once its longest sequence passes
    the original context, so a cached prefix keeps the factors it was computed with there as here; only a prompt that
    is longer than the original context from its first step differs: its early positions keep the short factors).
    """

    cos: torch.Tensor  # buffers (register_buffer below)
    sin: torch.Tensor

    def __init__(self, config: ModelConfig, rope: dict[str, Any], device: torch.device | None = None) -> None:
        super().__init__()
        half = rotary_dim(config, rope) // 2
        positions = torch.arange(config.max_position_embeddings, device="cpu").float()
        freqs = positions[:, None] * rope_inv_freq(config, rope)[None, :]  # [max_pos, rot/2]
        scale = 1.0
        if rope["rope_type"] == "longrope":
            original, scale = _longrope_scaling(config, rope)
            long = positions[original:, None] * rope_inv_freq(config, rope, long=True)[None, :]
            freqs[original:] = long
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_pos, rot]
        sin = emb.sin() * scale
        sin[:, :half] *= -1
        self.register_buffer("cos", (emb.cos() * scale).to(device), persistent=False)  # fp32, [max_pos, rot]
        self.register_buffer("sin", sin.to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, 1, rot] in `dtype` (broadcast over heads)."""
        return self.cos[positions, None].to(dtype), self.sin[positions, None].to(dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        # Qwen3 and Gemma 3 norm each q and k head over head_dim before RoPE
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer_cache: torch.Tensor,
        plan: AttentionPlan,
        lora: LayerLoraDelta | None,
        ops: LayerOps,
    ) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; writes this step's K/V into layer_cache."""
        num_tokens = x.shape[0]
        # [T, q_size + 2 * kv_size]: q | k | v, with the q, k and v deltas in their columns (one shrink for the three)
        qkv = self.qkv_proj(x) if lora is None else lora.linear("qkv", self.qkv_proj, x)
        if self.q_norm is None or self.k_norm is None:
            q, k, v = ops.rope_write_kv(qkv, cos, sin, layer_cache, plan, self.num_heads)
        else:
            q, k, v = ops.rope_write_kv(
                qkv,
                cos,
                sin,
                layer_cache,
                plan,
                self.num_heads,
                self.q_norm.weight,
                self.k_norm.weight,
                self.q_norm.eps,
            )
        out = paged_attention(q, k, v, layer_cache, plan, kv_written=True).reshape(num_tokens, self.q_size)
        return self.o_proj(out) if lora is None else lora.linear("o", self.o_proj, out)  # [T, hidden]


class GatedMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.activation = config.activation  # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
        bias = config.mlp_bias
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, lora: LayerLoraDelta | None, ops: LayerOps) -> torch.Tensor:
        act = None  # [T, intermediate]
        silu = self.activation == "silu"
        if silu and lora is None and ops.fused_activation and isinstance(self.gate_up_proj, PackedLinear):
            act = self.gate_up_proj.silu_mul(x)  # the GEMM and the activation in one op, where its route has one
        if act is None:
            # [T, 2 * intermediate]: gate | up
            gate_up = self.gate_up_proj(x) if lora is None else lora.linear("gate_up", self.gate_up_proj, x)
            act = ops.silu_mul(gate_up) if silu else ops.gelu_tanh_mul(gate_up)
        return self.down_proj(act) if lora is None else lora.linear("down", self.down_proj, act)


class DecoderLayer(nn.Module):
    """Norm, attention, norm, MLP, each block's output added to the residual stream. Gemma 3 also norms each block's
    output before adding it (`attn_out_norm`, `mlp_out_norm`: its checkpoint's post_attention_layernorm and
    post_feedforward_layernorm; its pre_feedforward_layernorm is our post_attention_layernorm, Llama's name for the
    norm before the MLP)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config)
        self.attn_out_norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if config.gemma_norms else None
        self.mlp_out_norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if config.gemma_norms else None

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer_cache: torch.Tensor,
        plan: AttentionPlan,
        lora: LayerLoraDelta | None,
        ops: LayerOps,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the stream is h + every earlier layer's
        outputs; the next layer (or the final norm) adds this output to it, fused with its norm."""
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        if residual is None:  # the first layer: h is the embeddings
            residual, x = h, ops.norm(h, norm1.weight, norm1.eps)
        else:
            x, residual = ops.add_norm(residual, h, norm1.weight, norm1.eps)
        attended = self.self_attn(x, cos, sin, layer_cache, plan, lora, ops)
        if self.attn_out_norm is not None:
            attended = ops.norm(attended, self.attn_out_norm.weight, self.attn_out_norm.eps)
        x, residual = ops.add_norm(residual, attended, norm2.weight, norm2.eps)
        out = self.mlp(x, lora, ops)
        if self.mlp_out_norm is not None:
            out = ops.norm(out, self.mlp_out_norm.weight, self.mlp_out_norm.eps)
        return out, residual


class CausalLM(nn.Module):
    """The decoder of every family engine/model/config.py serves. Parameters are named after HF's Llama, minus the
    `model.` prefix, with q/k/v fused into `qkv_proj` and gate/up into `gate_up_proj` (engine/model/loader.py maps each
    family's checkpoint onto them). `lm_head` is None when tied.

    `backends` (loragate_kernels/backends.py) names the routes its steps take: the layer ops, the attention kernel
    and, once `prepack` has run, the GEMMs; the runner reads its LoRA route from it."""

    embed_scale: torch.Tensor  # a buffer (register_buffer below)

    def __init__(self, config: ModelConfig, backends: Backends) -> None:
        super().__init__()
        self.config = config
        self.backends = backends
        self.ops: LayerOps = LAYER_OPS[backends.layer]
        self.embed_tokens: nn.Embedding | PanelEmbedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head: nn.Module | None = None  # nn.Linear, or engine/model/cpu_gemm.py's PackedLinear
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # one table per kind of layer (Gemma 3's local and global layers have their own RoPE bases)
        self.rotary = nn.ModuleDict(
            {kind: RotaryEmbedding(config, rope, backends.device) for kind, rope in config.rope_parameters.items()}
        )
        # Gemma multiplies the embeddings by sqrt(hidden) rounded to the model's dtype, as HF does
        scale = torch.tensor(config.embed_scale, dtype=backends.dtype, device=backends.device)
        self.register_buffer("embed_scale", scale, persistent=False)
        self.windows = sorted({config.window(i) for i in range(config.num_layers)})
        # what adapters' saved copies of the embedding and head are compared with (engine/lora/vocab_lora.py)
        model = weakref.ref(self)
        self.base_vocab = BaseVocab(lambda: None if (m := model()) is None else m.vocab_matrices())
        # the base's side of DoRA adapters' row scales (engine/lora/dora.py), taken by `prepack` from the plain weights
        self.dora_row_norms: list[dict[str, torch.Tensor]] | None = None
        # greedy rows' tokens without the whole fp32 head, where `prepack` built one (engine/model/head_screen.py)
        self.head_screen: HeadScreen | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        attn: AttentionMetadata,
        lora: LoraDelta | None = None,
        interrupt: threading.Event | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] for a flat batch.

        input_ids, positions: [T] int64, positions < max_position_embeddings (the RoPE table size).
        kv_cache: [num_layers, num_pages, 2, block_size, kvh, hd]; the K/V of all T tokens are
        written into it at attn.slot_mapping.
        lora: the step's adapter segments (weights read from the same pool), or None when no row has one.
        interrupt: when given and set, the pass stops before its next layer with StepInterrupted.
        """
        config, ops = self.config, self.ops
        h = self.embed_tokens(input_ids)  # [T, hidden]
        scale = None if config.embed_scale == 1.0 else self.embed_scale
        if scale is not None:
            h = h * scale
        if lora is not None:
            h = lora.embed(input_ids, h, scale)
        rope_dtype = ops.rope_dtype or h.dtype
        tables = {kind: rotary(positions, rope_dtype) for kind, rotary in self.rotary.items()}
        # Gather indices and masks once per step per attention window, shared by the layers that have it (the
        # window-independent parts once for all of them)
        block_size, kernel = kv_cache.shape[3], self.backends.attention
        plans: dict[int, AttentionPlan] = {}
        for w in self.windows:
            shared = next(iter(plans.values()), None)
            plans[w] = plan_attention(
                attn, block_size, config.num_kv_heads, h.dtype, kernel, w or None, config.attn_scale, shared
            )
        residual = None
        for i, (layer, layer_cache) in enumerate(zip(self.layers, kv_cache, strict=True)):
            if interrupt is not None and interrupt.is_set():
                raise StepInterrupted
            cos, sin = tables[config.layer_types[i]]
            plan = plans[config.window(i)]
            h, residual = layer(h, residual, cos, sin, layer_cache, plan, None if lora is None else lora.layer(i), ops)
        if residual is None:  # no layers
            return ops.norm(h, self.norm.weight, self.norm.eps)
        return ops.add_norm(residual, h, self.norm.weight, self.norm.eps)[0]

    def vocab_matrices(self) -> dict[str, torch.Tensor]:
        """The plain embedding matrix and LM head [vocab, hidden] (the embeddings for a tied head), until `prepack`
        lays the GEMMs' weights out and drops the plain ones."""
        assert isinstance(self.embed_tokens, nn.Embedding), "the plain embeddings are gone after prepack"
        head = self.lm_head
        if head is not None:
            assert isinstance(head, nn.Linear), "the plain LM head is gone after prepack"
        embeddings = self.embed_tokens.weight
        return {"embed_tokens": embeddings, "lm_head": embeddings if head is None else head.weight}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab]; call it only on the rows that are sampled (the head is wide)."""
        if self.lm_head is None:  # tied to the embeddings (a PanelEmbedding comes with its own head)
            assert isinstance(self.embed_tokens, nn.Embedding)
            return F.linear(hidden, self.embed_tokens.weight)
        return self.lm_head(hidden)

    def prepack(self, head_screen: bool = True) -> int:
        """Every projection and the LM head with weights laid out for the GEMM route of `backends`
        (engine/model/cpu_gemm.py; a tied head gets a copy of the embeddings in its route's layout, and reads them
        as they are on cpu/gemm.cpp's row-major route; on cpu/panels.cpp's route the embeddings are then read from
        the head's copy, `PanelEmbedding`, and the row-major one is dropped). Returns how many GEMMs were laid out
        (0 on the plain F.linear route). Adapters' copies of the embedding and head are compared with digests of the
        plain matrices, taken first where those are about to go (engine/lora/vocab_lora.py BaseVocab), and so are the
        projections' row norms DoRA's scales need (engine/lora/dora.py `row_norms`). Where `head_screen` and the route
        allow it (loragate_kernels/backends.py `Backends.head_screen`), the head's plain matrix also gives its greedy
        screen (engine/model/head_screen.py)."""
        plain_head = self.vocab_matrices()["lm_head"]
        if self.backends.gemm is not Gemm.TORCH:
            self.base_vocab.capture()
            self.dora_row_norms = row_norms(self)
        count = prepack_linears(self, self.backends)
        if count and self.lm_head is None and isinstance(self.embed_tokens, nn.Embedding):
            embeddings = self.embed_tokens.weight
            head = self.lm_head = packed_linear(embeddings, None, self.backends)
            count += head is not None
            if isinstance(head, PackedLinear) and head.panels and head.weight.dtype == embeddings.dtype:
                self.embed_tokens = PanelEmbedding(head.weight)
        packed = self.lm_head  # a PackedLinear on the panels route, where Backends.head_screen holds
        if head_screen and self.backends.head_screen and isinstance(packed, PackedLinear):
            if HeadScreen.supports(plain_head, packed.bias):
                self.head_screen = HeadScreen(plain_head, packed.weight)
        return count
