"""A Hugging Face Llama trained with tensor parallelism, handed over whole.

    plait run -n 2 examples/llama_tp.py

The model's own forward and ``labels=`` loss run unchanged; plait splits q/k/v/gate/up by
output, o/down by input and the embedding and head by vocabulary over the ``tp`` ranks
(grouped-query attention included), keeps AdamW's two parameter groups, and clips by the
global norm.
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
    vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
)  # fmt: skip
model = LlamaForCausalLM(config)
mesh = plait.Mesh(tp=plait.world().size)
model, opt = plait.prepare(model, adamw(model), strategy="tp", mesh=mesh)
data = tokens()
metrics = Metrics(model=config, seq_len=64, mesh=mesh, total=20, log_dir="runs/llama_tp")
for step in range(20):
    with metrics.data():
        x = batch(data, step, batch=8, seq=64)  # every rank: the same batch
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    norm = plait.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    metrics.step(loss, tokens=8 * 64, grad_norm=norm)  # tokens: the global batch's
    if plait.world().rank == 0 and step % 5 == 4:
        print(f"step {step + 1}: loss {loss.item():.3f}, grad norm {norm.item():.3f}")
metrics.close()
if plait.world().rank == 0:
    print(metrics.describe())
plait.shutdown()
