"""A Hugging Face Mixtral trained with PTD-P (pipeline x tensor x expert parallel), handed
over whole.

    plait run -n 4 examples/mixtral_ptdp.py         # pp 2 x tp 2
    plait run -n 4 examples/mixtral_ptdp.py --ep 2  # pp 2 x ep 2
    plait run -n 2 examples/mixtral_ptdp.py         # pp 2

The family's pipeline plan cuts the decoder layers into two stages (each sparse block on
its layer's stage); its tensor-parallel plan splits the attention over the ``tp`` ranks
and keeps each sparse block (router and experts) whole on every one of them; with ``--ep``
each rank of a stage keeps ``E/ep`` of its layers' experts and the chosen tokens travel to
them and back (the batch is cut over the ep ranks, as over data ranks). The load-balancing loss
is on: it multiplies means over every layer's router outputs of the whole batch, so each
step first runs the batch forward without autograd to sum them (one extra forward).
"""

from __future__ import annotations

import argparse

import torch
from _common import adamw, batch, tokens
from transformers import MixtralConfig, MixtralForCausalLM

import plait
from plait.metrics import Metrics

parser = argparse.ArgumentParser()
parser.add_argument("--ep", type=int, default=1)
ep = parser.parse_args().ep
plait.init()
torch.manual_seed(0)  # every rank builds the same model
config = MixtralConfig(
    vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
)  # fmt: skip
model = MixtralForCausalLM(config)
mesh = plait.Mesh(pp=2, dp=1, ep=ep, tp=plait.world().size // (2 * ep))
ptdp, opt = plait.prepare(
    model, adamw(model), strategy="ptdp", mesh=mesh, schedule="1f1b", microbatches=4
)
data = tokens()
metrics = Metrics(model=config, seq_len=64, mesh=mesh, total=20, log_dir="runs/mixtral_ptdp")
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
