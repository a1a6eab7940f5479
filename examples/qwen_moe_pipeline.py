"""A Hugging Face Qwen2-MoE (a shared expert beside the routed ones) trained with a pipeline,
its load-balancing loss kept, handed over whole.

    plait run -n 2 examples/qwen_moe_pipeline.py           # pp 2, zero-bubble ZB-H1

The family's pipeline plan cuts the decoder layers into two stages, each sparse block on its
layer's stage. The load-balancing loss multiplies two means over every layer's router
outputs of the whole batch, which no stage holds before the first backward: each step
first runs the batch forward without autograd to sum the routers' counts (one extra forward),
then the schedule carries the loss's exact gradient into every router.
"""

from __future__ import annotations

import torch
from _common import adamw, batch, tokens
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

import plait
from plait.metrics import Metrics

plait.init()
torch.manual_seed(0)  # every rank builds the same model
config = Qwen2MoeConfig(
    vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    moe_intermediate_size=128, shared_expert_intermediate_size=256, num_experts=4,
    num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.01,
)  # fmt: skip
model = Qwen2MoeForCausalLM(config)
mesh = plait.Mesh(pp=plait.world().size)
pipe, opt = plait.prepare(
    model, adamw(model), strategy="pipeline", mesh=mesh, schedule="zb-h1", microbatches=4
)
data = tokens()
metrics = Metrics(model=config, seq_len=64, mesh=mesh, total=20, log_dir="runs/qwen_moe_pipeline")
for step in range(20):
    with metrics.data():
        x = batch(data, step, batch=8, seq=64)  # every rank: the same global batch
    loss = pipe.step(x, x)  # the language-model loss + the load-balancing loss
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
