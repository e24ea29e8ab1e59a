"""Text in and out: a tokenizer.json in the model dir read with the `tokenizers` package (an optional extra), its
chat template from tokenizer_config.json, and incremental detokenization for streams and stop strings."""
from __future__ import annotations

import json
import os
from typing import Optional


class TextTokenizer:
    """encode / decode over a HF tokenizer.json; `chat_template` is the model's Jinja template or None."""

    def __init__(self, path: str, chat_template: Optional[str] = None):
        from tokenizers import Tokenizer
        self.tok = Tokenizer.from_file(path)
        self.chat_template = chat_template

    def __call__(self, text: str) -> list[int]:
        return self.encode(text)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    def max_token_bytes(self) -> int:
        """An upper bound on the UTF-8 bytes of text one token covers (its vocabulary string's bytes: byte-level and
        sentencepiece strings spell each byte with one or more bytes), so a text of b bytes takes >= b / this tokens."""
        return max(len(t.encode("utf-8")) for t in self.tok.get_vocab(with_added_tokens=True))

    def apply_chat_template(self, messages: list[dict]) -> str:
        """The prompt text for chat `messages` ([{role, content}]), ready for the model's reply."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template (no chat_template in tokenizer_config.json)")
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template).render(messages=messages, add_generation_prompt=True)


def load_tokenizer(model_dir: str) -> Optional[TextTokenizer]:
    """The model dir's tokenizer, or None without tokenizer.json (or without the `tokenizers` package)."""
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        return None
    template = None
    config = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.isfile(config):
        with open(config, encoding="utf-8") as f:
            template = json.load(f).get("chat_template")
    return TextTokenizer(path, template if isinstance(template, str) else None)


class Detokenizer:
    """One sequence's output text, grown token by token. `text` only ever grows by whole characters: while the
    decoded ids end in an incomplete UTF-8 sequence (U+FFFD at the end) the new text is held back, so streamed
    pieces concatenate to the final text and never split a multi-byte character.

    Each add decodes a window, not the whole sequence: the tokens of the last piece emitted (decoded again, so a
    decoder that treats a leading token specially treats it alike in both) and the new ones; a token costs the
    same at any length."""

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # ids[_prefix:_read] made the last piece of `text`
        self._read = 0  # ids[:_read] are in `text`

    def _window(self) -> tuple[Optional[str], str]:
        """(the text the ids after `_read` add, or None where it does not extend the last piece; the window's
        text)."""
        before = self.tokenizer.decode(self.ids[self._prefix:self._read])
        now = self.tokenizer.decode(self.ids[self._prefix:])
        return now[len(before):] if now.startswith(before) else None, now

    def add(self, ids: list[int]) -> str:
        """Append token ids; returns the text they completed (possibly empty)."""
        self.ids += ids
        new, now = self._window()
        if not new or now.endswith("\ufffd"):
            return ""
        self.text += new
        self._prefix, self._read = self._read, len(self.ids)
        return new

    def flush(self) -> str:
        """The sequence ended: whatever is still held back (an incomplete character decodes as U+FFFD)."""
        new = self._window()[0] or ""
        self.text += new
        self._prefix = self._read = len(self.ids)
        return new
