"""Text out: the embedded default's tokenizer (lossless byte-level BPE), incremental detokenization across multi-byte
characters, and the chat template."""
import pytest

from tp_lora.assets import DEFAULT_MODEL, TOKENIZER_TEXT, write_tiny_tokenizer
from tp_lora.engine.tokenizer import Detokenizer, load_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(write_tiny_tokenizer(str(tmp_path_factory.mktemp("tok"))))


def test_tokenizer_is_deterministic_and_fits_the_default_vocab(tok, tmp_path):
    again = load_tokenizer(write_tiny_tokenizer(str(tmp_path)))
    vocab = DEFAULT_MODEL["vocab_size"]
    assert tok.tok.to_str() == again.tok.to_str() and tok.tok.get_vocab_size() == vocab
    ids = tok.encode(TOKENIZER_TEXT)
    assert ids[0] == 1 and max(ids) < vocab and tok.decode(ids) == TOKENIZER_TEXT


def test_every_byte_is_a_token_so_no_character_is_dropped(tok):
    text = '{"key": [1, 2.5]} na\u00efve \u2014 \u65e5\u672c\u8a9e \x00\t~`|\\ \U0001F9EA\u0301'
    assert tok.decode(tok.encode(text)) == text
    assert all(len(tok.encode(chr(b))) == 2 for b in range(128))  # <s> and the character's own token
    assert tok.decode(tok.encode("\x80\xff")[1:]) == "\x80\xff"


def test_a_vocab_without_room_for_every_byte_is_an_error_naming_the_minimum(tmp_path):
    with pytest.raises(ValueError, match="vocab_size=256: .* at least 259"):
        write_tiny_tokenizer(str(tmp_path), 256)
    assert load_tokenizer(write_tiny_tokenizer(str(tmp_path), 259)).tok.get_vocab_size() == 259  # bytes, no merges


@pytest.mark.parametrize("text", ["Caf\u00e9 \u65e5\u672c\u8a9e \U0001F642!", "na\u00efve \u00fcber", "hello world"])
def test_streamed_pieces_are_whole_characters_and_add_up(tok, text):
    ids = tok.encode(text)[1:]
    assert any(not tok.decode([i]).isprintable() or "\ufffd" in tok.decode([i]) for i in ids) or text.isascii()
    d = Detokenizer(tok)
    pieces = [d.add([i]) for i in ids] + [d.flush()]
    assert all("\ufffd" not in p for p in pieces), pieces
    assert "".join(pieces) == text == d.text


def test_an_incomplete_character_comes_out_at_the_end(tok):
    ids = tok.encode("\U0001F642")[1:]
    d = Detokenizer(tok)
    assert [d.add([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert d.flush() == "\ufffd"  # the sequence ended mid-character: the replacement character, once


def test_chat_template(tok):
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "user: hi\nassistant:"


def _whole_sequence_pieces(tok, chunks: list[list[int]]) -> list[str]:
    """The reference: decode every id so far at each step, emit what extends the text unless it ends mid-character."""
    ids, text, out = [], "", []
    for c in chunks:
        ids += c
        now = tok.decode(ids)
        new = "" if now.endswith("\ufffd") or not now.startswith(text) else now[len(text):]
        text += new
        out.append(new)
    now = tok.decode(ids)
    out.append(now[len(text):] if now.startswith(text) else "")
    return out


@pytest.mark.parametrize("seed", range(4))
def test_windowed_pieces_match_decoding_the_whole_sequence(tok, seed):
    import random
    rng = random.Random(seed)
    for trial in range(200):  # real text with multi-byte characters, and random ids (invalid UTF-8 included)
        ids = tok.encode("Caf\u00e9 \u65e5\u672c \U0001F642 na\u00efve " * rng.randint(1, 3))[1:] if trial % 2 else \
            [rng.randrange(256) for _ in range(rng.randint(1, 40))]
        cuts = sorted(rng.sample(range(1, len(ids)), min(len(ids) - 1, rng.randint(0, 12)))) if len(ids) > 1 else []
        chunks = [ids[a:b] for a, b in zip([0] + cuts, cuts + [len(ids)])]
        d = Detokenizer(tok)
        pieces = [d.add(c) for c in chunks] + [d.flush()]
        assert pieces == _whole_sequence_pieces(tok, chunks), ids
        assert d.text == "".join(pieces)


def test_a_token_costs_the_same_at_any_length(tok):
    seen = []

    class Counting:
        def decode(self, ids):
            seen.append(len(ids))
            return tok.decode(ids)
    d = Detokenizer(Counting())
    ids = tok.encode("hello world, " * 200)[1:]
    for t in ids:
        d.add([t])
    assert d.text == tok.decode(ids) and max(seen) <= 8, max(seen)
