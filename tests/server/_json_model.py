"""A tiny random Llama that can spell JSON, for the structured-output tests: the embedded default's shape, with a
byte-level BPE over every byte (as the default's), a chat template, and two random
adapters; and the schemas the tests ask for, each with a bound on its strings, arrays and numbers so a random model's
document closes within a few dozen tokens."""
import json
import os

import jsonschema

from tp_lora.assets import CHAT_TEMPLATE, DEFAULT_MODEL, write_random_adapter, write_tiny_llama

VOCAB = 320
TEXT = ('{"name":"ada","age":36,"ok":true,"tags":["red","blue"],"user":{"id":7,"role":"guest"},"x":null,'
        '"score":-1.5e3} [1,2,3] hello world, the quick brown fox; 0123456789 ') * 8


def write_json_model(root) -> dict:
    """{'model': dir, 'adapter_dir': dir} under `root` (written once)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    model, adapters = os.path.join(root, "model"), os.path.join(root, "adapters")
    if os.path.isfile(os.path.join(model, "config.json")):
        return {"model": model, "adapter_dir": adapters}
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    os.makedirs(model, exist_ok=True)
    tok.save(os.path.join(model, "tokenizer.json"))
    with open(os.path.join(model, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE}, f)
    shape = {k: v for k, v in DEFAULT_MODEL.items() if k != "vocab_size"}
    write_tiny_llama(model, vocab_size=VOCAB, **shape)
    for i, name in enumerate(("alpha", "beta")):
        write_random_adapter(os.path.join(adapters, name), model, r=8, lora_alpha=16, seed=10 + i)
    return {"model": model, "adapter_dir": adapters}


def string(n: int, **kw) -> dict:
    return {"type": "string", "maxLength": n, **kw}


def integer(lo: int = 0, hi: int = 999) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def obj(props: dict, required=None, **kw) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            **kw}


SCHEMAS = [
    obj({"name": string(8)}),
    obj({"age": integer()}),
    obj({"ok": {"type": "boolean"}}),
    obj({"kind": {"enum": ["cat", "dog", "fish"]}}),
    obj({"x": {"type": "null"}, "y": {"const": "fixed"}}),
    obj({"name": string(6), "age": integer(0, 120), "ok": {"type": "boolean"}}),
    obj({"tags": {"type": "array", "items": string(5), "maxItems": 3}}),
    obj({"ids": {"type": "array", "items": integer(0, 99), "minItems": 1, "maxItems": 4}}),
    obj({"user": obj({"id": integer(), "role": {"enum": ["admin", "guest"]}})}),
    obj({"a": obj({"b": obj({"c": string(4)})})}),
    obj({"code": string(6, minLength=3)}),
    obj({"level": {"type": "integer", "enum": [1, 2, 3]}}),
    obj({"maybe": {"anyOf": [string(4), integer(0, 9)]}}),
    obj({"name": string(5), "nick": string(5)}, required=["name"]),
    {"type": "array", "items": integer(0, 9), "minItems": 2, "maxItems": 3},
    obj({"points": {"type": "array", "items": obj({"x": integer(0, 9), "y": integer(0, 9)}), "maxItems": 2}}),
    obj({"price": {"type": "number", "minimum": 0, "maximum": 100}}),
    obj({"word": {"type": "string", "pattern": "^[a-z]{1,6}$"}}),
    obj({"flag": {"type": "boolean"}, "label": {"enum": ["on", "off"]}, "n": integer(1, 5)}),
    obj({"pair": {"type": "array", "prefixItems": [string(3), integer(0, 9)], "items": False}}),
]


def fmt(schema: dict) -> dict:
    """The response_format asking for `schema`."""
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def valid(text: str, schema: dict) -> bool:
    """Whether text is a JSON document that `schema` accepts."""
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True
