"""A Hugging Face Llama cut into pipeline stages, handed over whole.

    plait run -n 2 examples/llama_pipeline.py

The family's pipeline plan cuts the decoder layers into stages; each stage recomputes the
rotary embeddings and the causal mask for its micro-batches (only activations travel), and
the loss is the model's own over the global batch. ``pipe.step(x, labels)`` runs forward and
backward through the schedule (here 1F1B over 4 micro-batches).
"""

from __future__ import annotations

import torch
from _common import adamw, batch, tokens
from transformers import LlamaConfig, LlamaForCausalLM

import plait
from plait.metrics import Metrics

plait.init()
torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
)  # fmt: skip
model = LlamaForCausalLM(config)
mesh = plait.Mesh(pp=plait.world().size)
pipe, opt = plait.prepare(
    model, adamw(model), strategy="pipeline", mesh=mesh, schedule="1f1b", microbatches=4
)
data = tokens()
metrics = Metrics(model=config, seq_len=64, mesh=mesh, total=20, log_dir="runs/llama_pipeline")
for step in range(20):
    with metrics.data():
        x = batch(data, step, batch=8, seq=64)  # every rank passes the same global batch
    loss = pipe.step(x, x)  # Hugging Face labels: the model shifts them itself
    norm = plait.clip_grad_norm_(pipe.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    metrics.step(loss, tokens=8 * 64, grad_norm=norm)  # tokens: the global batch's
    if plait.world().rank == 0 and step % 5 == 4:
        print(f"step {step + 1}: loss {loss.item():.3f}, grad norm {norm.item():.3f}")
metrics.close()
if plait.world().rank == 0:
    print(metrics.describe())
plait.shutdown()
