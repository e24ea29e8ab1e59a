"""Triton LoRA backend: the ops of tp_lora.ops.torch_ref (shrink, expand, embedding_shrink, lora_epilogue:
lora_launch.py; the fused MoE LoRA ops: moe_lora.py; modules_to_save's saved_embedding / saved_logits: the torch ops)
and what the engine asks of a backend beyond them: the scheduling scheme (schedule.py), the CUDA-graph buffers of a
step's batch (graphs.py) and the step sizes that compile every kernel variant."""
from tp_lora.ops.triton.graphs import bind_graph_buffers, graph_buffers, step_buffers
from tp_lora.ops.triton.lora_launch import embedding_shrink, expand, lora_epilogue, shrink, warm_up_sizes
from tp_lora.ops.triton.moe_lora import moe_lora_expand, moe_lora_fused, moe_lora_shrink
from tp_lora.ops.triton.schedule import prepare, set_scheme
# modules_to_save copies: a row gather / one GEMM per adapter group, the same ops on any device.
from tp_lora.ops.torch_ref import saved_embedding, saved_logits

__all__ = ["shrink", "expand", "embedding_shrink", "lora_epilogue", "saved_embedding", "saved_logits",
           "moe_lora_shrink", "moe_lora_expand", "moe_lora_fused", "set_scheme", "prepare", "graph_buffers",
           "bind_graph_buffers", "step_buffers", "warm_up_sizes"]
