"""tp_lora: tensor-parallel multi-LoRA inference. `from tp_lora import LLM` is the Python API."""


def __getattr__(name):
    if name == "LLM":  # imported on use: `import tp_lora.x` stays light (no torch for the config tools)
        from tp_lora.api import LLM
        return LLM
    raise AttributeError(f"module 'tp_lora' has no attribute {name!r}")
