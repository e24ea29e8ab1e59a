"""lora.dtype=fp8: B stored as float8_e4m3 with per-channel scales. Measures the memory saved and bounds the accuracy
cost against the unquantised adapter on a whole (tiny) model."""
import torch

from tp_lora import distributed as comm
from tp_lora.assets import write_random_adapter, write_tiny_llama
from tp_lora.config import RunConfig
from tp_lora.engine.engine import Engine
from tp_lora.engine.requests import Request
from tp_lora.engine.scoring import prompt_logits


def _engine(model, adapters, fp8: bool) -> Engine:
    cfg = RunConfig()
    cfg.device, cfg.dtype = "cpu", "float32"
    cfg.lora.dtype = "fp8" if fp8 else "auto"
    return Engine(cfg, comm.single_process(), str(model), str(adapters))


def test_fp8_adapters_are_smaller_and_close(tmp_path):
    write_tiny_llama(tmp_path / "m", seed=2)
    write_random_adapter(tmp_path / "a" / "x", tmp_path / "m", r=16, seed=5)
    reqs = [Request(0, id=0, adapter="x", prompt_token_ids=[3, 50, 7, 99, 12, 4])]
    base_reqs = [Request(0, id=0, adapter=None, prompt_token_ids=reqs[0].prompt_token_ids)]
    full, fp8 = _engine(tmp_path / "m", tmp_path / "a", False), _engine(tmp_path / "m", tmp_path / "a", True)
    ref, got = prompt_logits(full, reqs)[0], prompt_logits(fp8, reqs)[0]
    base = prompt_logits(full, base_reqs)[0]
    delta_err = float((got - ref).norm() / (ref - base).norm())  # error relative to what the adapter changes
    assert delta_err < 0.05, delta_err
    assert torch.equal(got.argmax(-1), ref.argmax(-1))

    def b_bytes(engine):
        layer = engine.model.layers[0].self_attn.qkv_proj
        return sum(b.numel() * b.element_size() for b in layer.lora_b) + \
            sum(s.numel() * s.element_size() for s in layer.b_scales or ())
    assert b_bytes(fp8) < 0.5 * b_bytes(full)  # vs float32 here; vs bfloat16 it is (r + 4) / 2r of the bytes
