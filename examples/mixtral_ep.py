"""A Hugging Face Mixtral with its experts spread over the ranks, handed over whole.

    plait run -n 2 examples/mixtral_ep.py

Each rank keeps E/ep of the experts; the model's own router decides, plait carries the
chosen tokens to the ranks holding their experts and back. Each rank trains on its slice of
the global batch (``batch_rank``); dense gradients are averaged over every data rank.
"""

from __future__ import annotations

import torch
from _common import adamw, batch, tokens
from transformers import MixtralConfig, MixtralForCausalLM

import plait
from plait.metrics import Metrics

plait.init()
torch.manual_seed(0)
config = MixtralConfig(
    vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
)  # fmt: skip
model = MixtralForCausalLM(config)
world = plait.world().size
mesh = plait.Mesh(ep=world)
model, opt = plait.prepare(model, adamw(model), strategy="ep", mesh=mesh)
rank = model.plait_expert_parallel.batch_rank
data = tokens()
metrics = Metrics(model=config, seq_len=64, mesh=mesh, total=20, log_dir="runs/mixtral_ep")
for step in range(20):
    with metrics.data():
        x = batch(data, step, batch=8, seq=64).chunk(world)[rank]  # this rank's rows
    loss = model(input_ids=x, labels=x).loss  # includes the load-balancing loss
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
