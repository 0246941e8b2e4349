"""xgrammar's view of a tokenizer's vocabulary, with the tokens compact JSON never needs taken out.

xgrammar reads a blank token as never allowed. Blanked here (found by random walks over the real vocabularies,
tests/engine/test_structured.py):
- special tokens other than EOS: as text, `<|im_start|>` would be allowed inside a JSON string, and the detokenizer
  (skipping special tokens) would then change the string;
- tokens holding a control byte (< 0x20): compact JSON never holds one raw, yet xgrammar's strings with a maxLength
  let them through (invalid JSON);
- tokens holding invalid UTF-8 (C0, C1, F5-FF, overlong forms, UTF-16 surrogates, code points past U+10FFFF): its
  strings with a pattern admit them, and the detokenizer would turn each into U+FFFD.
Invalid UTF-8 can also straddle two tokens (one ending with E0, ED, F0 or F4, the next starting with a continuation
byte those leads forbid): `follow[token]` is the AND mask that forbids those next tokens, applied for one step.
The bitmask is padded to whole int32 words with blanks, so its tail bits are written as 0 too.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
import weakref
from typing import Any

import numpy as np
import torch
import xgrammar

# A lead byte whose next byte has a narrower range than the continuation bytes (RFC 3629).
_SECOND_BYTE = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}
_NEVER_IN_JSON = re.compile(
    rb"[\x00-\x1f\xc0\xc1\xf5-\xff]|\xe0[\x80-\x9f]|\xed[\xa0-\xbf]|\xf0[\x80-\x8f]|\xf4[\x90-\xbf]"
)


class Vocabulary:
    """One tokenizer as the grammar engine sees it (built once per tokenizer object: ~1 s for 49k tokens)."""

    _ids = itertools.count()

    def __init__(self, tokenizer: Any) -> None:
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ValueError("structured outputs need a tokenizer with an EOS token")
        size = len(tokenizer)
        detected = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=size, stop_token_ids=[eos])
        decoded: list[bytes] = detected.decoded_vocab
        vocab: list[bytes | str] = [""] * ((size + 31) // 32 * 32)
        for piece, token_id in tokenizer.get_vocab().items():
            if token_id < size:
                vocab[token_id] = piece
        blank = set(tokenizer.all_special_ids)
        blank |= {i for i, added in tokenizer.added_tokens_decoder.items() if added.special}
        blank |= {i for i, data in enumerate(decoded) if _NEVER_IN_JSON.search(data)}
        for token_id in blank - {eos}:
            if token_id < size:
                vocab[token_id] = ""
        metadata = {**json.loads(detected.dump_metadata()), "vocab_size": len(vocab)}
        self.info = xgrammar.TokenizerInfo.from_vocab_and_metadata(vocab, json.dumps(metadata))
        self.eos = int(eos)
        self.words = len(vocab) // 32  # int32 words of a bitmask row the grammar writes
        self.key = f"vocab{next(self._ids)}-{size}"  # identity within this process
        self.follow = self._follow_masks(decoded, blank, eos)

    def _follow_masks(self, decoded: list[bytes], blank: set[int], eos: int) -> dict[int, torch.Tensor]:
        """token ending with a restricted lead byte -> AND mask ([words] int32) of the tokens that may follow it."""
        masks: dict[int, torch.Tensor] = {}
        for lead, (low, high) in _SECOND_BYTE.items():
            allowed = torch.ones(self.words * 32, dtype=torch.bool)
            for token_id, data in enumerate(decoded):
                if token_id != eos and token_id not in blank and data and 0x80 <= data[0] <= 0xBF:
                    allowed[token_id] = low <= data[0] <= high
            masks[lead] = _pack(allowed)
        return {
            token_id: masks[data[-1]]
            for token_id, data in enumerate(decoded)
            if token_id not in blank and data and data[-1] in masks
        }

    def info_json(self) -> str:
        return str(self.info.serialize_json())


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """[words * 32] bool -> [words] int32, bit j of word i = allowed[32 * i + j] (the bitmask layout)."""
    packed = np.packbits(allowed.numpy(), bitorder="little").view("<i4").astype(np.int32)
    return torch.from_numpy(packed)


_vocabularies: weakref.WeakKeyDictionary[Any, Vocabulary] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def vocabulary(tokenizer: Any) -> Vocabulary:
    """The Vocabulary of `tokenizer` (built on first use, kept as long as the tokenizer object lives)."""
    with _lock:
        entry = _vocabularies.get(tokenizer)
        if entry is None:
            entry = _vocabularies[tokenizer] = Vocabulary(tokenizer)
        return entry
