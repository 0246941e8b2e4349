"""Turn a request's generated tokens into text deltas, one step at a time, and find its stop strings.

Incremental decoding uses two offsets into `tokens` (a few prompt tokens of context, then the output):

    tokens[prefix_offset:read_offset]   already shown; decoded only as context for what follows
    tokens[read_offset:]                not shown yet

Each step decodes the short window `tokens[prefix_offset:]` and shows what it adds after the context's
text. Decoding a window instead of a single token keeps the tokenizer's leading-space and merge rules
right, and decoding a window instead of everything keeps each step O(1) in the output length. While the
window's text ends in U+FFFD, its last token holds only part of a UTF-8 sequence: nothing is shown and
the offsets stay put, so the character is shown whole once its remaining bytes arrive.

A fast tokenizer without clean-up of tokenization spaces is decoded by its Rust backend directly: that is
exactly what `tokenizer.decode` computes, without its per-call Python conversions. Its steps go through the
backend's `DecodeStream`, which runs the same window algorithm in Rust (one call per token instead of two decodes
and the list slicing around them: 0.7 vs 1.6 µs per token for SmolLM2's tokenizer); the offsets are tracked here
as well, so `flush` and a fallback to the Python steps (should the stream ever refuse a window) pick up where
it was. A byte-level (GPT-2 style) tokenizer, SmolLM2's among them, needs no tokenizer call at all per step:
its decode is the lossy UTF-8 decoding of its tokens' bytes joined, so with each token's bytes in a table
(`ByteLevelPieces`, built once per tokenizer and checked against its own decode), a step joins bytes and decodes
them in Python (in the engine's step loop, where the tokenizer's code is cold after the forward pass, ~1 µs
instead of ~10).

Stop strings are matched on the shown text. The longest tail that could still begin a stop string is
held back, so a stop string split over several tokens is cut exactly and never shown.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from tokenizers import Tokenizer, decoders
from transformers import PreTrainedTokenizerBase

from engine.core.request import SamplingParams

# tokenizers >= 0.21 (None before); its `ids` (the context to continue) came later: without them, the Python steps run
DecodeStream: type[decoders.DecodeStream] | None = getattr(decoders, "DecodeStream", None)

# Prompt tokens decoded as context before the first output token (enough for leading-space rules).
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


def _byte_level_chars() -> dict[str, int]:
    """The byte-level alphabet (GPT-2's): each byte is written as one printable character. Printable Latin-1 bytes
    stand for themselves; the other 68 (controls, space, 127-160, 173) take the characters from U+0100 on, in
    byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {chr(b): b for b in kept}
    others = (b for b in range(256) if chr(b) not in chars)
    chars.update({chr(256 + n): b for n, b in enumerate(others)})
    return chars


class ByteLevelPieces:
    """A byte-level tokenizer's tokens as the bytes they decode to, and which of them are special.

    Its decoder (tokenizers' `ByteLevel`) maps each token's characters back to bytes (a token with a character
    outside the alphabet, such as an added token's, stands for its own UTF-8) and decodes the bytes of all tokens
    joined, replacing invalid sequences with U+FFFD. So decode(ids) == b"".join(pieces).decode("utf-8", "replace"),
    which `build` checks on random sequences against the tokenizer's own decode before anything relies on it.
    """

    def __init__(self, pieces: list[bytes], special: frozenset[int]) -> None:
        self.pieces = pieces  # [len(tokenizer)]: token id -> its bytes (b"" for an id with no token)
        self.special = special

    @classmethod
    def build(cls, tokenizer: PreTrainedTokenizerBase) -> ByteLevelPieces | None:
        """The table for `tokenizer`, or None when it does not decode this way (another decoder, clean-up of
        tokenization spaces, or any disagreement with its own decode)."""
        backend = getattr(tokenizer, "_tokenizer", None)
        if (
            backend is None
            or getattr(tokenizer, "clean_up_tokenization_spaces", True)
            or not isinstance(backend.decoder, decoders.ByteLevel)
        ):
            return None
        alphabet = _byte_level_chars()
        pieces = []
        for token_id in range(len(tokenizer)):
            token = backend.id_to_token(token_id)
            if token is None:
                pieces.append(b"")
            elif all(c in alphabet for c in token):
                pieces.append(bytes(alphabet[c] for c in token))
            else:
                pieces.append(token.encode("utf-8"))
        special = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        table = cls(pieces, special)
        return table if table._agrees_with(backend) else None

    def decode(self, token_ids: list[int], skip_special: bool) -> str:
        return b"".join(self.bytes_of(t, skip_special) for t in token_ids).decode("utf-8", "replace")

    def bytes_of(self, token_id: int, skip_special: bool) -> bytes:
        if skip_special and token_id in self.special or not 0 <= token_id < len(self.pieces):
            return b""
        return self.pieces[token_id]

    def _agrees_with(self, backend: Tokenizer, trials: int = 64) -> bool:
        """Random sequences (special tokens and bytes that split characters included) decode alike both ways."""
        rng = random.Random(0)
        vocab = len(self.pieces)
        for _ in range(trials):
            length = rng.randrange(1, 24)
            ids = [rng.choice((rng.randrange(vocab), rng.randrange(min(vocab, 300)))) for _ in range(length)]
            for skip in (True, False):
                if self.decode(ids, skip) != backend.decode(ids, skip_special_tokens=skip):
                    return False
        return True


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        stream: bool = True,
        pieces: ByteLevelPieces | None = None,
    ) -> None:
        """`pieces`: the tokenizer's `ByteLevelPieces` (built once by the caller), to step without the tokenizer;
        otherwise a fast tokenizer steps through its backend's DecodeStream. `stream=False`: the Python steps
        whatever the tokenizer (what the other steps are tested against)."""
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        backend: Tokenizer | None = getattr(tokenizer, "_tokenizer", None)
        self._backend = backend
        self._backend_decode = (
            backend.decode
            if backend is not None
            and hasattr(backend, "decode")
            and not getattr(tokenizer, "clean_up_tokenization_spaces", True)
            else None
        )
        self._stops = tuple(params.stop)
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        # A prompt that ends inside a UTF-8 sequence would glue its bytes to the first output token's;
        # the output text must decode on its own, so such a prompt gives no context.
        context_text = self._decode(context)
        if context_text.endswith(_REPLACEMENT):
            context, context_text = [], ""
        self._tokens: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = context_text  # text of tokens[prefix_offset:read_offset] (kept up to date
        # by the Python steps only: the others recompute it where it is needed, in `flush` or on a fallback)
        # What turns the next token into new text: the Python window steps (`_python_step`), the backend's
        # DecodeStream (`_stream_step`), or the byte table (`_bytes_step`, whose pending bytes are those of
        # tokens[read_offset:]).
        self._next_text: Callable[[int], str] = self._python_step
        self._stream: decoders.DecodeStream | None = None
        self._pieces = pieces
        self._pending_bytes = b""
        if pieces is not None and stream and self._backend_decode is not None:
            self._next_text = self._bytes_step
        elif stream and self._backend_decode is not None and DecodeStream is not None:
            try:
                self._stream = DecodeStream(ids=context, skip_special_tokens=self._skip_special)
                self._next_text = self._stream_step
            except TypeError:  # pragma: no cover - a DecodeStream without `ids`
                pass
        self._pending = ""  # decoded, but held back: it may be the start of a stop string
        self._parts: list[str] = []  # text returned so far
        self._stopped = False

    @property
    def text(self) -> str:
        """The output text decoded so far, including text held back for stop matching (not an
        incomplete UTF-8 tail); once a stop string is hit, exactly the text before it."""
        return "".join(self._parts) + self._pending

    @property
    def stopped(self) -> bool:
        """True once a stop string was hit."""
        return self._stopped

    def update(self, new_token_ids: list[int]) -> tuple[str, bool]:
        """Append generated tokens; return (text delta now safe to show, stop_string_hit). Several tokens are
        taken one at a time, exactly as if they came in separate calls (text shows as soon as it is whole; a stop
        string ends the output at the first token that completes one)."""
        if self._stopped:
            return "", True
        if not self._stops and len(new_token_ids) == 1:  # the engine's usual step
            self._tokens.append(new_token_ids[0])
            text = self._next_text(new_token_ids[0])
            if text:
                self._parts.append(text)
            return text, False
        shown = ""
        for token in new_token_ids:
            self._tokens.append(token)
            delta, hit = self._scan(self._next_text(token), final=False)
            shown += delta
            if hit:  # the tokens after it are never shown
                return shown, True
        return shown, False

    def flush(self) -> str:
        """On a finish for any other reason: the text still held back (an incomplete UTF-8 tail is
        shown as the tokenizer decodes it, with U+FFFD), cut at a stop string if it holds one."""
        if self._stopped:
            return ""
        if self._next_text != self._python_step:  # the other steps do not keep the context's text
            self._prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        tail = self._decode(self._tokens[self._prefix_offset :])[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset = len(self._tokens)
        self._prefix_text = ""
        delta, _ = self._scan(tail, final=True)
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(token_ids, skip_special_tokens=self._skip_special)
        text = self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special)
        if not isinstance(text, str):  # never: decode gives a list only for a batch of sequences
            raise TypeError(f"the tokenizer decoded one sequence to {type(text).__name__}, not str")
        return text

    def _python_step(self, token: int) -> str:
        return self._decode_new()

    def _bytes_step(self, token: int) -> str:
        """`_decode_new` from the byte table: the window's text is its context's followed by the decoded pending
        bytes (the context ends with a whole character: it was shown), so only those are decoded."""
        if self._pieces is None:  # never: this step is chosen only with a table
            raise RuntimeError("the byte-table step without a byte table")
        self._pending_bytes += self._pieces.bytes_of(token, self._skip_special)
        text = self._pending_bytes.decode("utf-8", "replace")
        if not text or text.endswith(_REPLACEMENT):
            return ""
        self._pending_bytes = b""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        return text

    def _stream_step(self, token: int) -> str:
        """`_decode_new` by the backend's DecodeStream (`token` is already the last of `_tokens`)."""
        if self._stream is None or self._backend is None:  # never: this step is chosen only with both
            raise RuntimeError("the DecodeStream step without a DecodeStream")
        try:
            chunk = self._stream.step(self._backend, token)
        except Exception:  # e.g. a window whose text does not extend its context's: the Python steps go on
            self._stream = None
            self._next_text = self._python_step
            self._prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
            return self._decode_new()
        if chunk is None:
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        return chunk

    def _decode_new(self) -> str:
        """The text the unread tokens add, or "" while it is not complete yet."""
        window_text = self._decode(self._tokens[self._prefix_offset :])
        if len(window_text) <= len(self._prefix_text) or window_text.endswith(_REPLACEMENT):
            return ""
        new_text = window_text[len(self._prefix_text) :]
        # The shown tokens become the next window's context.
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        self._prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        return new_text

    def _scan(self, new_text: str, final: bool) -> tuple[str, bool]:
        """Match stop strings over pending + new_text; return (text to show, stop_string_hit)."""
        if not self._stops:  # nothing to match or hold back
            if new_text:
                self._parts.append(new_text)
            return new_text, False
        buffer = self._pending + new_text
        cut = min((i for i in (buffer.find(s) for s in self._stops) if i >= 0), default=None)
        if cut is not None:
            self._stopped = True
            self._pending = ""
            self._parts.append(buffer[:cut])
            return buffer[:cut], True
        hold = 0 if final else self._hold_length(buffer)
        shown, self._pending = buffer[: len(buffer) - hold], buffer[len(buffer) - hold :]
        if shown:
            self._parts.append(shown)
        return shown, False

    def _hold_length(self, buffer: str) -> int:
        """Length of the longest tail of `buffer` that is a proper prefix of some stop string."""
        # Invariant: no stop string occurs in buffer (checked by the caller), and earlier text was
        # shown only when no stop string could start in it, so a match can start only in the tail.
        for length in range(min(self._max_hold, len(buffer)), 0, -1):
            tail = buffer[-length:]
            if any(s.startswith(tail) for s in self._stops):
                return length
        return 0
