"""Text out: the embedded default's tokenizer, incremental detokenization across multi-byte characters, and the
chat template."""
import pytest

from tp_lora.assets import TOKENIZER_TEXT, write_tiny_tokenizer
from tp_lora.engine.tokenizer import Detokenizer, load_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(write_tiny_tokenizer(str(tmp_path_factory.mktemp("tok"))))


def test_tokenizer_is_deterministic_and_fits_the_default_vocab(tok, tmp_path):
    again = load_tokenizer(write_tiny_tokenizer(str(tmp_path)))
    assert tok.tok.to_str() == again.tok.to_str() and tok.tok.get_vocab_size() == 256
    ids = tok.encode(TOKENIZER_TEXT)
    assert ids[0] == 1 and max(ids) < 256 and tok.decode(ids) == TOKENIZER_TEXT


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
