"""A Hugging Face GPT-2 trained with tensor parallelism, or a pipeline, handed over whole.

    plait run -n 2 examples/gpt2_tp.py                     # tp 2
    plait run -n 2 examples/gpt2_tp.py --pipeline          # pp 2, 1F1B

GPT-2 stores its projections as ``Conv1D`` (the weight ``[in, out]``, a transposed linear)
and its query, key and value fused in one ``c_attn``: plait's GPT-2 plan splits each of q, k
and v by heads inside the fused weight, ``c_proj`` and the MLP as Megatron does, and the tied
embedding and head by vocabulary. With ``--pipeline`` the family's pipeline plan cuts the
blocks into two stages, the tied embedding and head on the first and last stage, their
gradients summed between them. Both print the same losses (float32, to the last digits).
"""

from __future__ import annotations

import argparse

import torch
from _common import adamw, batch, tokens
from transformers import GPT2Config, GPT2LMHeadModel

import plait
from plait.metrics import Metrics

parser = argparse.ArgumentParser()
parser.add_argument("--pipeline", action="store_true")
pipeline = parser.parse_args().pipeline
plait.init()
torch.manual_seed(0)  # every rank builds the same model
config = GPT2Config(
    vocab_size=256, n_positions=128, n_embd=128, n_layer=2, n_head=4,
    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # tensor parallelism refuses dropout
)  # fmt: skip
model = GPT2LMHeadModel(config)
n = plait.world().size
mesh = plait.Mesh(pp=n) if pipeline else plait.Mesh(tp=n)
if pipeline:
    model, opt = plait.prepare(model, adamw(model), strategy="pipeline", mesh=mesh, microbatches=4)
else:
    model, opt = plait.prepare(model, adamw(model), strategy="tp", mesh=mesh)
data = tokens()
metrics = Metrics(model=config, seq_len=64, mesh=mesh, total=20, log_dir="runs/gpt2_tp")
for step in range(20):
    with metrics.data():
        x = batch(data, step, batch=8, seq=64)  # every rank: the same batch
    if pipeline:
        loss = model.step(x, x)  # Hugging Face labels: the plan's loss shifts them
    else:
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
