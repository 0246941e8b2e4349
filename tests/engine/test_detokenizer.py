"""IncrementalDetokenizer against the tokenizer's own full decode, and stop strings against str.find."""

from __future__ import annotations

import random
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from engine.core.detokenizer import ByteLevelPieces, IncrementalDetokenizer
from engine.core.request import SamplingParams

# Multilingual on purpose: with a small vocabulary, CJK and emoji bytes get split across tokens.
_TRAIN_TEXT = [
    "Hello world, this is a test. The quick brown fox jumps over the lazy dog.",
    "日本語のテキストです。中文文本也在这里。한국어 텍스트도 있습니다.",
    "Emojis: 😀🎉👍🏽 🇯🇵 and café, naïve, résumé, Zürich.",
    "Привет мир! Γειά σου κόσμε. مرحبا بالعالم",
] * 3
_SAMPLE_TEXTS = [
    "Hello world! 日本語のテキスト 😀🎉 café résumé",
    "The quick brown fox 👍🏽 jumps over 中文文本 the lazy dog.",
    "Привет мир 🇯🇵 Γειά σου κόσμε, naïve Zürich 한국어",
]


def _byte_bpe() -> PreTrainedTokenizerBase:
    """A GPT-2 style byte-level BPE trained here, so tests need nothing from a model hub."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_TRAIN_TEXT, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>")


def _metaspace() -> PreTrainedTokenizerBase:
    """A SentencePiece-style BPE ("▁" marks a space; decoding drops the text's leading space)."""
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=150, special_tokens=["<unk>", "</s>"], show_progress=False)
    backend.train_from_iterator(_TRAIN_TEXT[:1] * 3, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="<unk>")


def _tiny_random() -> PreTrainedTokenizerBase:
    from engine.model.sources import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model("tiny-random").path)


@pytest.fixture(scope="module", params=["byte_bpe", "tiny_random"])
def tokenizer(request: pytest.FixtureRequest) -> PreTrainedTokenizerBase:
    return _byte_bpe() if request.param == "byte_bpe" else _tiny_random()


@pytest.fixture(scope="module")
def byte_bpe() -> PreTrainedTokenizerBase:
    return _byte_bpe()


def _stream(
    tokenizer: PreTrainedTokenizerBase, prompt: list[int], output: list[int], params: SamplingParams, chunks: int = 1
) -> tuple[list[str], bool, int, str]:
    """Feed `output` in chunks of up to `chunks` tokens; stop at a stop-string hit like the engine does.

    Returns (deltas, hit, tokens fed when it ended, flushed text or "").
    """
    detok = IncrementalDetokenizer(tokenizer, prompt, params)
    deltas, fed = [], 0
    while fed < len(output):
        step = output[fed : fed + chunks]
        fed += len(step)
        delta, hit = detok.update(step)
        deltas.append(delta)
        if hit:
            return deltas, True, fed, ""
    return deltas, False, fed, detok.flush()


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("chunks", [1, 3])
def test_random_token_sequences_match_full_decode(
    tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool, chunks: int
) -> None:
    rng = random.Random(1234)
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    vocab = len(tokenizer)
    for _ in range(150):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
        output = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        deltas, hit, _, flushed = _stream(tokenizer, prompt, output, params, chunks)
        assert not hit
        expected = tokenizer.decode(output, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) + flushed == expected, (prompt, output)


def test_real_text_matches_full_decode_and_never_shows_replacement(tokenizer: PreTrainedTokenizerBase) -> None:
    split_chars = 0
    for text in _SAMPLE_TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        split_chars += sum("\ufffd" in tokenizer.decode([i]) for i in ids)
        prompt = tokenizer.encode("Say:", add_special_tokens=False)
        deltas, _, _, flushed = _stream(tokenizer, prompt, ids, SamplingParams())
        assert all("\ufffd" not in d for d in deltas)
        assert flushed == ""
        assert "".join(deltas) == tokenizer.decode(ids) == text
    assert split_chars > 0, "the texts must split multi-byte characters across tokens"


def test_prompt_context_keeps_leading_space(tokenizer: PreTrainedTokenizerBase) -> None:
    prompt = tokenizer.encode("Hello", add_special_tokens=False)
    output = tokenizer.encode(" world and more", add_special_tokens=False)
    deltas, _, _, flushed = _stream(tokenizer, prompt, output, SamplingParams())
    assert deltas[0].startswith(" ")
    assert "".join(deltas) + flushed == " world and more"


def test_sentencepiece_style_continues_the_prompt_text() -> None:
    # Decoding the output alone would drop its leading space; the prompt's tokens as context keep it.
    sp = _metaspace()
    ids = sp.encode("Hello world and more", add_special_tokens=False)
    assert sp.convert_ids_to_tokens(ids)[1].startswith("\u2581")
    deltas, _, _, flushed = _stream(sp, ids[:1], ids[1:], SamplingParams())
    assert "".join(deltas) + flushed == " world and more"
    rng = random.Random(7)
    for _ in range(200):
        prompt = [rng.randrange(len(sp)) for _ in range(rng.randrange(0, 8))]
        output = [rng.randrange(len(sp)) for _ in range(rng.randrange(1, 30))]
        deltas, _, _, flushed = _stream(sp, prompt, output, SamplingParams())
        prompt_text = sp.decode(prompt, skip_special_tokens=True)
        full = sp.decode(prompt + output, skip_special_tokens=True)
        assert full.startswith(prompt_text)
        assert "".join(deltas) + flushed == full[len(prompt_text) :], (prompt, output)


def test_window_stays_short_on_long_outputs(byte_bpe: PreTrainedTokenizerBase) -> None:
    longest = 0

    def counted(decode: Any) -> Any:
        def wrapper(ids: list[int], skip_special_tokens: bool = False) -> str:
            nonlocal longest
            longest = max(longest, len(ids))
            return decode(ids, skip_special_tokens=skip_special_tokens)

        return wrapper

    class CountingBackend:  # the detokenizer decodes with a fast tokenizer's backend directly
        def __getattr__(self, name: str) -> object:
            return getattr(byte_bpe._tokenizer, name)

        decode = staticmethod(counted(byte_bpe._tokenizer.decode))

    class Counting:
        _tokenizer = CountingBackend()

        def __getattr__(self, name: str) -> object:
            return getattr(byte_bpe, name)

        decode = staticmethod(counted(byte_bpe.decode))

    ids = byte_bpe.encode(" ".join(_SAMPLE_TEXTS) * 10, add_special_tokens=False)
    assert len(ids) > 300
    detok = IncrementalDetokenizer(Counting(), ids[:5], SamplingParams())  # type: ignore[arg-type]
    shown = "".join(detok.update([i])[0] for i in ids)
    assert shown + detok.flush() == byte_bpe.decode(ids)
    assert 0 < longest <= 12


def _earliest_cut(text: str, stops: tuple[str, ...]) -> str | None:
    hits = [text.find(s) for s in stops if s in text]
    return text[: min(hits)] if hits else None


@pytest.mark.parametrize("chunks", [1, 2])
def test_random_stop_strings_cut_exactly(tokenizer: PreTrainedTokenizerBase, chunks: int) -> None:
    rng = random.Random(99)
    for case in range(120):
        text = rng.choice(_SAMPLE_TEXTS)
        ids = tokenizer.encode(text, add_special_tokens=False)
        full = tokenizer.decode(ids)
        stops = []
        for _ in range(rng.choice([1, 2, 3])):
            start = rng.randrange(len(full) - 1)
            stops.append(full[start : start + rng.randrange(1, 7)])
        if case % 4 == 0:
            stops.append("never there")
        params = SamplingParams(stop=tuple(stops))
        deltas, hit, fed, flushed = _stream(tokenizer, [], ids, params, chunks)
        # Generation ends with the chunk of the first token whose complete text (the output up to it) holds a
        # stop string; the output is that text cut before the earliest stop string in it.
        texts = [tokenizer.decode(ids[:n]) for n in range(1, len(ids) + 1)]
        first = next(
            n for n, t in enumerate(texts, 1) if not t.endswith("\ufffd") and _earliest_cut(t, params.stop) is not None
        )
        assert hit and flushed == "" and fed == min(-(-first // chunks) * chunks, len(ids))
        assert "".join(deltas) == _earliest_cut(texts[first - 1], params.stop), (full, stops)
        if len(stops) == 1:
            assert "".join(deltas) == full.split(stops[0])[0]
        shown = ""
        for d in deltas:  # no stop string is ever shown, not even in part beyond the cut
            shown += d
            assert _earliest_cut(shown, params.stop) is None


def test_earliest_of_several_stops_wins(byte_bpe: PreTrainedTokenizerBase) -> None:
    ids = byte_bpe.encode("Hello world foo bar", add_special_tokens=False)
    cases = {
        ("bar", "world"): "Hello ",
        ("world", "bar"): "Hello ",
        ("o w", "world"): "Hell",
        ("foo", "o"): "Hell",
        ("r", "ld f"): "Hello wo",
    }
    for stops, expected in cases.items():
        deltas, hit, _, _ = _stream(byte_bpe, [], ids, SamplingParams(stop=stops))
        assert hit and "".join(deltas) == expected, stops
        # All at once, both stops are complete in the same step: the one that starts first wins.
        detok = IncrementalDetokenizer(byte_bpe, [], SamplingParams(stop=stops))
        assert detok.update(ids) == ("Hello world foo bar".split(stops[0])[0].split(stops[1])[0], True)


def test_possible_stop_prefix_is_held_then_released(byte_bpe: PreTrainedTokenizerBase) -> None:
    detok = IncrementalDetokenizer(byte_bpe, [], SamplingParams(stop=("world",)))
    assert detok.update(byte_bpe.encode("Hello", add_special_tokens=False)) == ("Hello", False)
    assert detok.update(byte_bpe.encode(" wor", add_special_tokens=False)) == (" ", False)
    assert detok.text == "Hello wor"
    assert detok.update(byte_bpe.encode("ms", add_special_tokens=False)) == ("worms", False)
    assert detok.update(byte_bpe.encode(" world", add_special_tokens=False)) == (" ", True)
    assert detok.text == "Hello worms "
    assert detok.update(byte_bpe.encode("more", add_special_tokens=False)) == ("", True)
    assert detok.flush() == ""


def test_flush_returns_held_tail_when_no_stop_hit(byte_bpe: PreTrainedTokenizerBase) -> None:
    detok = IncrementalDetokenizer(byte_bpe, [], SamplingParams(stop=("world peace",)))
    shown, hit = detok.update(byte_bpe.encode("Hello world", add_special_tokens=False))
    assert (shown, hit) == ("Hello ", False)
    assert detok.flush() == "world"
    assert detok.text == "Hello world"


def test_flush_shows_incomplete_utf8_tail_as_the_tokenizer_does(byte_bpe: PreTrainedTokenizerBase) -> None:
    emoji = byte_bpe.encode("😀", add_special_tokens=False)
    assert len(emoji) > 1  # split across tokens
    ids = byte_bpe.encode("ok ", add_special_tokens=False) + emoji[:-1]
    deltas, _, _, flushed = _stream(byte_bpe, [], ids, SamplingParams())
    assert "".join(deltas) == "ok "
    assert "".join(deltas) + flushed == byte_bpe.decode(ids)
    assert flushed.endswith("\ufffd")


def _run(detok: IncrementalDetokenizer, output: list[int], chunks: int) -> tuple[list[tuple[str, bool]], str, str]:
    steps = [detok.update(output[i : i + chunks]) for i in range(0, len(output), chunks)]
    return steps, detok.flush(), detok.text


@pytest.mark.parametrize("kind", ["byte_bpe", "tiny_random", "metaspace"])
def test_decode_stream_steps_equal_the_python_steps(kind: str) -> None:
    """The backend's DecodeStream (the default for fast tokenizers) and, for byte-level tokenizers, the byte table
    (what the engine uses for them) against the window algorithm in Python: every delta, every stop hit, the
    flushed tail and the final text, on random tokens (special ones and split UTF-8 sequences included) with random
    stop strings."""
    tokenizer = {"byte_bpe": _byte_bpe, "tiny_random": _tiny_random, "metaspace": _metaspace}[kind]()
    pieces = ByteLevelPieces.build(tokenizer)  # the byte table's steps too, where the tokenizer is byte-level
    assert (pieces is None) == (kind == "metaspace")
    rng = random.Random(21)
    vocab = len(tokenizer)
    for case in range(200):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
        output = [rng.randrange(vocab) for _ in range(rng.randrange(1, 50))]
        text = tokenizer.decode(output)
        starts = rng.sample(range(len(text)), min(2, len(text))) if case % 3 else []
        stops = tuple(text[i : i + rng.randrange(1, 4)] for i in starts)
        params = SamplingParams(stop=stops, skip_special_tokens=case % 4 != 1)
        chunks = rng.choice([1, 1, 3])
        streamed = IncrementalDetokenizer(tokenizer, prompt, params)
        assert streamed._stream is not None
        python = IncrementalDetokenizer(tokenizer, prompt, params, stream=False)
        expected = _run(python, output, chunks)
        assert _run(streamed, output, chunks) == expected, (prompt, output, params.stop)
        if pieces is not None:
            from_bytes = IncrementalDetokenizer(tokenizer, prompt, params, pieces=pieces)
            assert _run(from_bytes, output, chunks) == expected, (prompt, output, params.stop)


def test_a_refusing_stream_hands_over_to_the_python_steps(
    byte_bpe: PreTrainedTokenizerBase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Should the DecodeStream raise (its window's text not extending its context's), the Python steps take over
    from the offsets of the last text shown, and the output is the same as theirs throughout."""
    import engine.core.detokenizer as detokenizer_module

    real = detokenizer_module.DecodeStream

    class Refusing:
        def __init__(self, fail_at: int, **kwargs: Any) -> None:
            self.inner, self.fail_at, self.steps = real(**kwargs), fail_at, 0

        def step(self, backend: Any, token: int) -> str | None:
            self.steps += 1
            if self.steps == self.fail_at:
                raise Exception("Invalid prefix encountered")
            return self.inner.step(backend, token)

    ids = byte_bpe.encode(_SAMPLE_TEXTS[0] + _SAMPLE_TEXTS[1], add_special_tokens=False)
    prompt = byte_bpe.encode("Say:", add_special_tokens=False)
    params = SamplingParams(stop=("never there",))
    expected = _run(IncrementalDetokenizer(byte_bpe, prompt, params, stream=False), ids, 1)
    for fail_at in (1, 2, 7, len(ids)):
        monkeypatch.setattr(detokenizer_module, "DecodeStream", lambda fail_at=fail_at, **kw: Refusing(fail_at, **kw))
        detok = IncrementalDetokenizer(byte_bpe, prompt, params)
        assert _run(detok, ids, 1) == expected
        assert detok._stream is None  # it did take over


@pytest.mark.smollm2
def test_byte_table_decodes_as_smollm2s_tokenizer() -> None:
    """SmolLM2's real tokenizer (byte-level, 49,152 tokens): its byte table decodes random sequences, special tokens
    and lone bytes of multi-byte characters included, exactly as the tokenizer does, with and without special
    tokens; a sequence of every token id in turn too."""
    from engine.model.sources import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model("smollm2").path)
    pieces = ByteLevelPieces.build(tokenizer)
    assert pieces is not None and len(pieces.pieces) == len(tokenizer)
    rng = random.Random(5)
    vocab = len(tokenizer)
    sequences = [
        [rng.choice((rng.randrange(vocab), rng.randrange(300))) for _ in range(rng.randrange(1, 40))]
        for _ in range(400)
    ]
    sequences += [list(range(start, min(start + 64, vocab))) for start in range(0, vocab, 64)]
    for ids in sequences:
        for skip in (True, False):
            assert pieces.decode(ids, skip) == tokenizer.decode(ids, skip_special_tokens=skip), ids


def test_a_tokenizer_that_is_not_byte_level_gets_no_byte_table() -> None:
    assert ByteLevelPieces.build(_metaspace()) is None
    assert ByteLevelPieces.build(_byte_bpe()) is not None


def test_the_byte_table_is_checked_against_the_tokenizer(byte_bpe: PreTrainedTokenizerBase) -> None:
    """`build` keeps a table only if it decodes as the tokenizer does: one wrong piece, or special tokens not known
    as such, and the check fails."""
    pieces = ByteLevelPieces.build(byte_bpe)
    assert pieces is not None and pieces._agrees_with(byte_bpe._tokenizer)
    wrong_piece = ByteLevelPieces(list(pieces.pieces), pieces.special)
    common = max(range(len(wrong_piece.pieces)), key=lambda i: len(wrong_piece.pieces[i]) if i < 300 else 0)
    wrong_piece.pieces[common] = b"?"
    assert not wrong_piece._agrees_with(byte_bpe._tokenizer, trials=400)
    assert not ByteLevelPieces(pieces.pieces, frozenset())._agrees_with(byte_bpe._tokenizer, trials=400)
