"""A Hugging Face Llama sharded with FSDP, one unit per decoder layer, with Hugging Face's
gradient checkpointing.

    plait run -n 2 examples/llama_fsdp.py
"""

from __future__ import annotations

import torch
from _common import adamw, batch, tokens
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import plait
from plait.metrics import Metrics

plait.init()
torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
)  # fmt: skip
model = LlamaForCausalLM(config)
model.gradient_checkpointing_enable()
model, opt = plait.prepare(model, adamw(model), strategy="fsdp", wrap={LlamaDecoderLayer})
world, rank = plait.world().size, plait.world().rank
data = tokens()
metrics = Metrics(model=config, seq_len=64, total=20, log_dir="runs/llama_fsdp")
for step in range(20):
    with metrics.data():
        x = batch(data, step, batch=8, seq=64).chunk(world)[rank]  # this rank's rows
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    norm = plait.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    metrics.step(loss, tokens=8 * 64, grad_norm=norm)  # tokens: the global batch's
    if rank == 0 and step % 5 == 4:
        print(f"step {step + 1}: loss {loss.item():.3f}, grad norm {norm.item():.3f}")
metrics.close()
if rank == 0:
    print(metrics.describe())
plait.shutdown()
