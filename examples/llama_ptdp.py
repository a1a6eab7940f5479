"""A Hugging Face Llama trained with PTD-P (pipeline x tensor x data parallel), handed over
whole.

    plait run -n 4 examples/llama_ptdp.py           # pp 2 x tp 2
    plait run -n 8 examples/llama_ptdp.py           # pp 2 x dp 2 x tp 2

The family's pipeline plan cuts the decoder layers into two stages, its tensor-parallel
plan splits every stage over the ``tp`` ranks (q/k/v/gate/up by output, o/down by input,
the embedding and head by vocabulary, grouped-query attention included); each stage
rebuilds the rotary embeddings and the causal mask itself, and the loss is the model's own
``labels=`` loss over the global batch. AdamW keeps its two parameter groups, and
``ptdp.clip_grad_norm_`` clips by the whole model's norm.
"""

from __future__ import annotations

import torch
from _common import adamw, batch, tokens
from transformers import LlamaConfig, LlamaForCausalLM

import plait
from plait.metrics import Metrics

plait.init()
torch.manual_seed(0)  # every rank builds the same model
config = LlamaConfig(
    vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
)  # fmt: skip
model = LlamaForCausalLM(config)
mesh = plait.Mesh(pp=2, dp=plait.world().size // 4, tp=2)
ptdp, opt = plait.prepare(
    model, adamw(model), strategy="ptdp", mesh=mesh, schedule="1f1b", microbatches=4
)
data = tokens()
metrics = Metrics(model=config, seq_len=64, mesh=mesh, total=20, log_dir="runs/llama_ptdp")
for step in range(20):
    with metrics.data():
        x = batch(data, step, batch=8, seq=64)  # every rank passes the same global batch
    loss = ptdp.step(x, x)  # Hugging Face labels: the model shifts them itself
    norm = ptdp.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()
    metrics.step(loss, tokens=8 * 64, grad_norm=norm)  # tokens: the global batch's
    if plait.world().rank == 0 and step % 5 == 4:
        print(f"step {step + 1}: loss {loss.item():.3f}, grad norm {norm.item():.3f}")
metrics.close()
if plait.world().rank == 0:
    print(metrics.describe())
plait.shutdown()
