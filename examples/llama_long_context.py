"""A Hugging Face Llama on long windows with context parallelism: every rank holds part of
every sequence, attention runs as ring attention over the ``cp`` ranks.

    plait run -n 2 examples/llama_long_context.py               # cp 2, FSDP over cp
    plait run -n 4 examples/llama_long_context.py               # cp 4
    plait run -n 4 examples/llama_long_context.py --pipeline    # pp 2 x cp 2 (PTD-P)

Without ``--pipeline``: ``plait.prepare(strategy="cp", zero=3)``. Each rank feeds two
chunks of every window (``shard_sequence``: chunks ``i`` and ``2c-1-i``, so the causal work
is balanced) with their global ``position_ids``; the model's attention is swapped for ring
attention (K/V blocks travel round the cp ranks), and FSDP shards its parameters, gradients
and AdamW state over the cp ranks. Each rank's loss is its tokens' sum over the global
batch's count, times cp, so the averaged gradient is one process's.

With ``--pipeline``: ``plait.prepare(strategy="ptdp", mesh=Mesh(pp=2, cp=...))``;
``ptdp.step(ids, labels)`` takes the whole global batch with Hugging Face labels, shifts
them over the whole sequence, cuts the sequence itself and gives every stage its rank's
global positions; the loss is the model's own ``labels=`` loss. Both print the same
losses on the same windows (float32, up to the last digits).
"""

from __future__ import annotations

import sys

import torch
from _common import adamw, batch, tokens
from torch.nn import functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import plait
from plait.metrics import Metrics
from plait.strategies.context import shard_sequence

SEQ = 512  # long for this model: 4 layers of width 128

plait.init()
torch.manual_seed(0)  # every rank builds the same model
config = LlamaConfig(
    vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
    attn_implementation="sdpa",
)  # fmt: skip
model = LlamaForCausalLM(config)
world = plait.world().size
data = tokens()
metrics = Metrics(model=config, seq_len=SEQ, total=20, log_dir="runs/llama_long_context")
if "--pipeline" in sys.argv:
    mesh = plait.Mesh(pp=2, dp=1, tp=1, cp=world // 2)
    ptdp, opt = plait.prepare(
        model, adamw(model), strategy="ptdp", mesh=mesh, context="ring", microbatches=2
    )
    for step in range(20):
        with metrics.data():
            x = batch(data, step, batch=4, seq=SEQ)  # every rank passes the same global batch
        loss = ptdp.step(x, x)  # Hugging Face labels: PTD-P shifts them over the sequence
        norm = ptdp.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        metrics.step(loss, tokens=4 * SEQ, grad_norm=norm)  # tokens: the global batch's
        if plait.world().rank == 0 and step % 5 == 4:
            print(f"step {step + 1}: loss {loss.item():.3f}, grad norm {norm.item():.3f}")
else:
    mesh = plait.Mesh(cp=world)
    runner, opt = plait.prepare(
        model, adamw(model), strategy="cp", mesh=mesh, context="ring", zero=3
    )
    assert opt is not None
    for step in range(20):
        with metrics.data():
            x = batch(data, step, batch=4, seq=SEQ)  # the same windows as --pipeline
        # next-token targets over the whole window (the last has none), then cut like x
        targets = torch.cat([x[:, 1:], torch.full_like(x[:, :1], -100)], dim=1)
        count = int((targets != -100).sum())  # the global batch's loss items
        ids, pos = shard_sequence(x, mesh)  # this rank's two chunks and their positions
        mine, _ = shard_sequence(targets, mesh)
        logits = runner(input_ids=ids, position_ids=pos).logits
        total = F.cross_entropy(logits.flatten(0, 1).float(), mine.flatten(), reduction="sum")
        loss = total * world / count  # averaged over the cp ranks: the global mean
        loss.backward()  # gradients averaged over the cp ranks (FSDP's reduce-scatter)
        norm = runner.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        plait.comm.all_reduce(mean, "avg")  # the global batch's loss
        metrics.step(mean, tokens=4 * SEQ, grad_norm=norm)
        if plait.world().rank == 0 and step % 5 == 4:
            print(f"step {step + 1}: loss {mean.item():.3f}, grad norm {norm.item():.3f}")
metrics.close()
if plait.world().rank == 0:
    print(metrics.describe())
plait.shutdown()
