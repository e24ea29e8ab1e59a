"""Optional text prompts: a tokenizer.json in the model dir read with the `tokenizers` package (an optional extra)."""
from __future__ import annotations

import os
from typing import Callable, Optional


def load_tokenizer(model_dir: str) -> Optional[Callable[[str], list[int]]]:
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    tok = Tokenizer.from_file(path)
    return lambda text: tok.encode(text).ids
