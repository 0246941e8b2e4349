"""Random-weight models with a real model's published shape, for speed figures only.

Throughput does not depend on weight values, so a model family whose weights cannot be a dependency here (gated,
licence-bound) is measured on a model with its published config.json and deterministic random weights, built
locally once into the cache (`cache_root()/bench-models/<name>-v<N>`, atomically, as engine/model/sources.py builds
"tiny-random"). Its outputs mean nothing; its shapes, and so its cost per token, are the real model's.

    "gemma3-270m-shape"  Gemma 3 270M (`Gemma3ForCausalLM`, 268M parameters): `GEMMA3_270M` holds the values of
                         the model's published config.json (google/gemma-3-270m on the Hugging Face Hub, as its
                         fine-tunes carry it too), field for field but for the weights' dtype

bench/throughput.py, bench/vllm_w1.py and bench/w1_compare.py take these names as `--model` (`model_spec` maps a
name to the directory the engine and vLLM load).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.model.sources import build_atomically, cache_root

# Bump the version when the built contents change, so stale cache entries are never reused.
GEMMA3_270M_SHAPE = "gemma3-270m-shape"
GEMMA3_270M_DIR = "gemma3-270m-shape-v1"

# Gemma 3 270M's published config.json (google/gemma-3-270m), in its own field names (transformers turns the two
# RoPE bases into `rope_parameters`). Its dtype (bf16) is left out: weights are saved in fp32 and each run picks
# its dtype. Every 6th layer is global (full attention, rope_theta 1e6), the others slide over 512 tokens
# (rope_local_base_freq 1e4).
GEMMA3_270M: dict[str, Any] = {
    "vocab_size": 262144,
    "hidden_size": 640,
    "intermediate_size": 2048,
    "num_hidden_layers": 18,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 32768,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
    "tie_word_embeddings": True,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 512,
    "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "use_bidirectional_attention": False,
}

# Gemma's own ids for the tokens a chat turn needs; every other id is a distinct word.
_GEMMA_SPECIALS = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<start_of_turn>": 105, "<end_of_turn>": 106}
_NEWLINE_ID = 107
_WORDS = (
    "the quick brown fox jumps over a lazy dog while serving many adapters at once "
    "user model system what is capital of france paris hello how are you"
).split()
_GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{{ message['content'] + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def shaped_model_names() -> tuple[str, ...]:
    return (GEMMA3_270M_SHAPE,)


def model_spec(name: str) -> str:
    """What `EngineConfig.model` and `resolve_model` take for a bench model name: a shaped model's directory
    (built on first use), anything else unchanged ("smollm2", "tiny-random", a path)."""
    if name == GEMMA3_270M_SHAPE:
        return str(build_gemma3_270m_shape(cache_root() / "bench-models" / GEMMA3_270M_DIR))
    return name


def build_gemma3_270m_shape(dest: Path) -> Path:
    """Gemma 3 270M's shape with deterministic random weights and a 262,144-entry tokenizer, into `dest` (once:
    an existing `dest` is reused; a build happens beside it and is renamed into place)."""
    return dest if dest.is_dir() else build_atomically(dest, _write_gemma3_270m_shape)


def _write_gemma3_270m_shape(path: Path) -> None:
    """HF's own init (normal(0, 0.02) matrices, Gemma's (1 + w) norms at w = 0), seeded: logits stay within a few
    units in fp32 and bf16. Saved as safetensors in fp32 (~1 GB)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(**GEMMA3_270M)
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config)  # fp32: torch's default dtype
    model.save_pretrained(str(path), safe_serialization=True)
    _gemma_shaped_tokenizer().save_pretrained(str(path))


def _gemma_shaped_tokenizer() -> Any:
    """A word-level tokenizer with one entry per id of the model's vocabulary, so any id a random model emits
    detokenizes. Gemma's specials and newline sit at Gemma's ids; words are SentencePiece-style ("▁word"), so
    text round-trips with its spaces; `<bos>` starts every encoding as Gemma's tokenizer does."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    size = GEMMA3_270M["vocab_size"]
    fixed = {**_GEMMA_SPECIALS, "\n": _NEWLINE_ID}
    free = (i for i in range(size) if i not in fixed.values())
    vocab = dict(fixed)
    vocab.update({f"▁{word}": next(free) for word in _WORDS})
    vocab.update({f"▁w{i}": i for i in free})
    assert sorted(vocab.values()) == list(range(size))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _GEMMA_SPECIALS])
    backend.add_tokens([AddedToken("\n", special=False, normalized=False)])
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", _GEMMA_SPECIALS["<bos>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        chat_template=_GEMMA_TEMPLATE,
    )
