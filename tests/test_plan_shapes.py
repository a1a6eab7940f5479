"""The planner's memory for other shapes (GQA, SwiGLU, fused attention), its communication
buffers, the memory-bound term of the step time, and `plait plan fit`: pure arithmetic,
each against a value derived by hand."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from plait.plan import hf
from plait.plan.activations import (
    activation_memory,
    model_layer_bytes,
    per_layer_bytes,
    rank_activations,
)
from plait.plan.buffers import BUCKET_BYTES, buffer_bytes, gathered_unit
from plait.plan.cli import default_subcommand
from plait.plan.fit import breakdown
from plait.plan.hardware import a100
from plait.plan.layout import Job, Layout
from plait.plan.model import ModelSpec, published
from plait.plan.report import explain
from plait.plan.search import evaluate
from plait.plan.states import rank_params, rank_states
from plait.plan.time import step_time


def test_gpt_formula_is_unchanged() -> None:
    # Korthikanti Table 2: s b h (34 + 5 a s / h), e = 2, k = 1
    s, b, h, a = 2048, 1, 12288, 96
    assert per_layer_bytes(s=s, b=b, h=h, a=a) == s * b * h * (34 + 5 * a * s / h)


def test_gqa_swiglu_fused_attention_by_hand() -> None:
    # Llama 3 8B: h 4096, 32 heads of 128, 8 kv heads (kv 1024), f 14336; bf16, no dropout
    m = hf.load("llama3-8b")
    job = Job(global_batch=1, seq=8192, dropout=False, flash_attention=True)
    s, h, q, kv, f = 8192, 4096, 4096, 1024, 14336
    # two RMSNorms: fp32 input, normalised input, output (the q/k/v and MLP inputs)
    whole = 2 * (4 + 2 * 2) * h
    # Q K V, out-proj input (fused attention); SwiGLU: gate, silu(gate), up, down input
    split = 2 * (2 * q + 2 * kv) + 4 * 2 * f
    lse = 4 * 32  # fp32 log-sum-exp per head and token
    assert model_layer_bytes(m, job, Layout()) == s * (whole + split + lse)
    # tp 2 without SP: the whole part stays, the rest halves
    lay = Layout(tp=2)
    assert model_layer_bytes(m, job, lay) == s * whole + s * (split + lse) / 2
    # unfused (eager) attention repeats K and V to the queries' width and keeps the fp32
    # softmax and its bf16 cast: (4 + e) a s^2 = 6 * 32 * s^2 without dropout
    unfused = replace(job, flash_attention=False)
    eager_split = 2 * 4 * q + 4 * 2 * f
    assert model_layer_bytes(m, unfused, Layout()) == s * (whole + eager_split) + 6 * 32 * s * s


def test_mixture_of_experts_block_by_hand() -> None:
    # Mixtral 8x7B: h 4096, 32 heads of 128, 8 kv heads, 8 experts of x 14336, top 2; bf16,
    # fused attention, no dropout (module doc of plait.plan.activations, "mixture-of-experts")
    m = hf.load("mixtral-8x7b")
    job = Job(global_batch=1, seq=4096, dropout=False, flash_attention=True)
    s, h, q, kv, x, e, E, k = 4096, 4096, 4096, 1024, 14336, 2, 8, 2
    whole = 2 * (4 + 2 * e) * h  # the two RMSNorms (the MLP's input among them)
    split = e * (2 * q + 2 * kv) + 4 * 32  # fused attention and its log-sum-exp
    router = 4 * E + 8 * k + 4 * k + 4  # fp32 softmax, int64 top-k, renormalised weights
    copy = 4 * e * x + 2 * e * h + 4 + 24  # SwiGLU, gathered input, down output, weight, ids
    moe = router + k * copy
    assert model_layer_bytes(m, job, Layout(), moe=True) == s * (whole + moe + split)
    # the dense count of the same block (what the planner had): 4 e x in place of moe
    assert model_layer_bytes(m, job, Layout()) == s * (whole + 4 * e * x + split)
    # tp 2 without SP: the sparse block is whole on every rank, so are its tensors
    assert model_layer_bytes(m, job, Layout(tp=2), moe=True) == s * (whole + moe) + s * split / 2
    # with SP each rank routes its s / t tokens
    sp = Layout(tp=2, sp=True)
    assert model_layer_bytes(m, job, sp, moe=True) == s * (whole + moe + split) / 2
    # expert parallelism: k s rows per rank on average, as without it (imbalance not modelled)
    ep = Layout(ep=2)
    assert model_layer_bytes(m, job, ep, moe=True) == model_layer_bytes(m, job, Layout(), moe=True)


def test_dense_and_moe_blocks_per_pipeline_rank() -> None:
    # Qwen2-MoE-like: 4 layers, block 0 dense (mlp_only_layers), a shared expert; pp 2 1F1B
    # with 4 micro-batches: rank 0 holds blocks 0 (dense) and 1 (MoE) for 2 micro-batches,
    # rank 1 blocks 2 and 3 (MoE) for 1, and the head
    cfg = dict(
        model_type="qwen2_moe", hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=176, vocab_size=128, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=176,
        mlp_only_layers=[0],
    )  # fmt: skip
    m = hf.from_hf_config(cfg)
    assert [m.is_moe(i) for i in range(4)] == [False, True, True, True]
    job = Job(global_batch=4, seq=32, dropout=False, flash_attention=True)
    lay = Layout(pp=2, schedule="1f1b")
    dense, moe = model_layer_bytes(m, job, lay), model_layer_bytes(m, job, lay, moe=True)
    # the shared expert (SwiGLU 4 e g, its output and gate e h + e) and no renormalisation
    e, h, x, g, E, k = 2, 64, 48, 176, 4, 2
    per_token = 4 * E + 8 * k + k * (4 * e * x + 2 * e * h + 28) + 4 * e * g + e * h + e
    assert moe - dense == 32 * (per_token - 4 * e * 176)
    act = activation_memory(m, job, lay)
    head = (4 + 2 * e) * 32 * h + (e + 4) * 32 * 128
    first, last = 2 * (dense + moe), 2 * moe + head
    assert act.total == max(first, last)
    assert act.per_layer == dense and act.per_moe_layer == moe


QWEN2_MOE_TINY = dict(
    model_type="qwen2_moe", hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, intermediate_size=176, vocab_size=128, num_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=176,
    mlp_only_layers=[0],
)  # fmt: skip


def test_moe_block_states_are_whole_on_every_tp_rank() -> None:
    # plait's tp plan of Qwen2-MoE (plait.models.qwen_moe.tp_plan = mixtral.moe_tp_plan)
    # splits attention and the dense MLP of block 0 and keeps each sparse block whole:
    # router, routed experts, shared expert and its gate. By hand, h 64, q 4 x 16 = 64,
    # kv 2 x 16 = 32, SwiGLU without biases, q/k/v biases, two RMSNorms, untied head:
    m = hf.from_hf_config(QWEN2_MOE_TINY)
    h = 64
    attention = h * (64 + 2 * 32) + 64 * h + (64 + 2 * 32)  # q/k/v/o weights, q/k/v bias
    norms = 2 * h
    dense_mlp = 3 * 176 * h
    router, shared, shared_gate = h * 4, 3 * 176 * h, h
    experts = 4 * 3 * 48 * h  # per MoE block
    embedding = head = 128 * h
    final_norm = h
    # one rank of tp 2: attention, the dense MLP, embedding and head halve; the rest whole
    dense_block = (attention + dense_mlp) // 2 + norms  # 23,232
    moe_block = attention // 2 + norms + router + shared + shared_gate  # 40,448
    want = dense_block + 3 * moe_block + (embedding + head) // 2 + final_norm
    assert rank_params(m, Layout(tp=2)) == [(want, 3 * experts)]
    assert want == 152_832  # (the old rule, the shared expert split: 102,144)
    # expert parallelism divides the routed experts only; tp 1 holds the whole model
    assert rank_params(m, Layout(tp=2, ep=2)) == [(want, 3 * experts // 2)]
    ((d1, x1),) = rank_params(m, Layout())
    assert d1 + x1 == m.num_params
    # so the states of one tp 2 rank: 16 bytes per parameter (mixed, Adam), no ZeRO, and
    # Adam's step counters (a tensor each: 1 per RMSNorm; 4 q/k/v/o + 3 biases; 3 per MLP;
    # the router; the shared gate; 3 per expert; embedding, final norm, head)
    job = Job(global_batch=2, seq=32)
    tensors = (2 + 7 + 3) + 3 * (2 + 7 + 1 + 3 + 1 + 4 * 3) + 3
    states = rank_states(m, job, Layout(tp=2))[0]
    assert states.total_bytes == 16 * (want + 3 * experts) + 4 * tensors


def test_plaits_gpt_moe_block_is_whole_on_every_tp_rank() -> None:
    # plait.models.gpt.tp_plan splits attention and the dense MLPs only; an MoE block's
    # gate and experts stay whole (PTD-P: experts split over ep, replicated over tp).
    # h 16, 2 blocks (block 1 MoE, 4 experts of f = 4): by hand
    m = ModelSpec(layers=2, hidden=16, heads=2, vocab=32, seq_len=8, experts=4, moe_every=2)
    h = 16
    attention_split = 3 * h * h + 3 * h + h * h  # qkv W and b, proj W
    dense_split = attention_split + 4 * h * h + 4 * h + 4 * h * h  # fc1 W and b, fc2 W
    whole = 2 * 2 * h + h  # two LayerNorms, proj bias
    expert = 2 * 4 * h * h + 5 * h  # fc1, fc2 W and b
    embedding = 32 // 2 * h + 8 * h  # vocabulary-parallel tokens, whole positions
    head = 32 // 2 * h + 2 * h  # vocabulary-parallel head, whole final LayerNorm
    dense_block = dense_split // 2 + whole + h  # + fc2 bias
    moe_block = attention_split // 2 + whole + h * 4  # + the gate, whole
    assert rank_params(m, Layout(tp=2)) == [
        (dense_block + moe_block + embedding + head, 4 * expert)
    ]


def test_moe_mlp_flops_are_not_divided_by_tp() -> None:
    # Mixtral 8x7B on 8 A100s, tp 8, no memory-bound term: every tp rank runs each sparse
    # block whole (mixtral.moe_tp_plan), so only attention and the head are divided by 8.
    # Forward FLOPs per token, h 4096, q 4096, kv 1024, 8 experts of 14336, top 2, s 4096:
    m = hf.load("mixtral-8x7b")
    job = Job(global_batch=1, seq=4096, dropout=False)
    c = replace(a100(1), elementwise_passes=0.0)
    h, q, kv, x, s, V, L = 4096, 4096, 1024, 14336, 4096, 32000, 32
    attention = 2 * (h * (q + 2 * kv) + q * h) + 4 * s * q  # projections, QK^T and AV
    mlp = 2 * 2 * 3 * x * h + 2 * h * 8  # top_k SwiGLU experts, the router
    head = 2 * h * V
    rate = c.peak_flops * c.efficiency
    # forward + backward = 3 forwards; one micro-batch of 1 sequence
    want = 3 * s * (L * (attention / 8 + mlp) + head / 8) / rate
    got = step_time(m, job, Layout(tp=8), c).compute_per_mb
    assert math.isclose(got, want, rel_tol=1e-12)
    # under SP each rank routes its s / 8 tokens: everything is divided by 8
    sp = step_time(m, job, Layout(tp=8, sp=True), c).compute_per_mb
    assert math.isclose(sp, 3 * s * (L * (attention + mlp) + head) / 8 / rate, rel_tol=1e-12)
    # full recomputation reruns the forward of both parts
    full = step_time(m, job, Layout(tp=8, recompute="full"), c).compute_per_mb
    want_full = s * (4 * L * (attention / 8 + mlp) + 3 * head / 8) / rate
    assert math.isclose(full, want_full, rel_tol=1e-12)


def test_flash_attention_runs_half_the_causal_square() -> None:
    """Llama 3 8B on one A100, no memory-bound term, s 8192, one sequence. Forward FLOPs per
    token and block: projections 2 (h (q + 2 kv) + q h) = 2 (4096 x 6144 + 4096^2) =
    83,886,080; SwiGLU 2 x 3 f h = 6 x 14336 x 4096 = 352,321,536; attention core
    QK^T and PV 4 s q = 4 x 8192 x 4096 = 134,217,728. The head 2 h V = 2 x 4096 x 128256.
    Unfused (Megatron-LM's kernels): 3 passes of all of it. FlashAttention with the causal
    mask runs half the core in each pass (the tiles above the diagonal are skipped) and its
    backward recomputes Q K^T (half the core), itself half run: 3 x core / 2 + core / 4.
    Without the skip (causal_skip=False): 3 x core + core / 2."""
    m = hf.load("llama3-8b")
    c = replace(a100(1), elementwise_passes=0.0)
    s, h, L, V = 8192, 4096, 32, 128256
    lin = 2 * (h * (4096 + 2 * 1024) + 4096 * h) + 2 * 3 * 14336 * h
    core = 4 * s * 4096
    assert (lin, core) == (436_207_616, 134_217_728)
    head = 2 * h * V
    rate = c.peak_flops * c.efficiency

    def compute(job: Job) -> float:
        return step_time(m, job, Layout(), c).compute_per_mb

    unfused = Job(global_batch=1, seq=s, dropout=False)
    want = s * (L * 3 * (lin + core) + 3 * head) / rate
    assert math.isclose(compute(unfused), want, rel_tol=1e-12)
    flash = replace(unfused, flash_attention=True)
    assert flash.causal_skip and flash.causal_share == 0.5
    want = s * (L * (3 * lin + 3 * core / 2 + core / 4) + 3 * head) / rate
    assert math.isclose(compute(flash), want, rel_tol=1e-12)
    whole = replace(flash, causal_skip=False)
    assert whole.causal_share == 1.0
    want = s * (L * (3 * lin + 3 * core + core / 2) + 3 * head) / rate
    assert math.isclose(compute(whole), want, rel_tol=1e-12)
    # full recomputation: the rerun forward's core is halved too (4 passes)
    full = step_time(m, flash, Layout(recompute="full"), c).compute_per_mb
    want = s * (L * (4 * lin + 4 * core / 2 + core / 4) + 3 * head) / rate
    assert math.isclose(full, want, rel_tol=1e-12)
    # MFU keeps the model FLOPs' formula (the whole square): the same for every kernel
    mfu = step_time(m, flash, Layout(), c).model_flops
    assert mfu == step_time(m, unfused, Layout(), c).model_flops
    assert mfu == m.flops_per_iteration(batch=1, seq=s)


def test_buffers_by_hand() -> None:
    m = published("175B")
    job = Job(global_batch=64, seq=2048)
    act = 2048 * 12288 * 2
    assert buffer_bytes(m, job, Layout()) == 0
    assert buffer_bytes(m, job, Layout(dp=8)) == 2 * BUCKET_BYTES
    assert buffer_bytes(m, job, Layout(tp=8, pp=8, schedule="1f1b")) == 2 * act / 8
    split, whole = m.block_split()
    assert buffer_bytes(m, job, Layout(dp=8, zero=3)) == 3 * 2 * (split + whole)


def test_fsdp_buffer_is_the_largest_gathered_block_moe_included() -> None:
    """plait's GPT, h 64, f 4, 4 experts, every 2nd block MoE (block 1), e = 2 bytes.
    Dense block: qkv 3h^2 + 3h = 12,480, proj h^2 + h = 4,160, fc1 4h^2 + 4h = 16,640, fc2
    4h^2 + h = 16,448, two LayerNorms 4h = 256: 49,984.
    MoE block: attention 16,640 + LayerNorms 256 + router h E = 256: 17,152; one expert
    2 f h^2 + (f + 1) h = 32,768 + 320 = 33,088, four local at ep 1: 132,352; 149,504 in all,
    three times the dense block, which sized the buffer before."""
    m = ModelSpec(layers=2, hidden=64, heads=4, vocab=256, seq_len=32, experts=4, top_k=2)
    job = Job(global_batch=8, seq=32)
    assert sum(m.block_split()) == 49_984
    assert gathered_unit(m, Layout(dp=4, zero=3)) == 149_504
    # the used, the prefetched and the gradient: 3 x 2 B x 149,504
    assert buffer_bytes(m, job, Layout(dp=4, zero=3)) == 897_024
    # ep 2: two local experts, 17,152 + 66,176 = 83,328 (still above the dense 49,984)
    assert gathered_unit(m, Layout(dp=2, ep=2, zero=3)) == 83_328
    # tp 2: the attention's split part (16,576 of it) halves, the experts stay whole
    assert gathered_unit(m, Layout(dp=2, tp=2, zero=3)) == 149_504 - 16_576 / 2
    # no experts: the dense block
    dense = ModelSpec(layers=2, hidden=64, heads=4, vocab=256, seq_len=32)
    assert gathered_unit(dense, Layout(dp=4, zero=3)) == 49_984


def test_memory_bound_term_adds_passes_over_activations() -> None:
    m, job = published("22B"), Job(global_batch=4, seq=2048)
    lay = Layout(tp=8, microbatch=4, recompute="full")
    off = replace(a100(1), elementwise_passes=0.0)
    on = replace(off, elementwise_passes=2.0)
    moved = 2.0 * model_layer_bytes(m, job, lay, recompute="none") * 4 / 3 / on.hbm_bandwidth
    extra = step_time(m, job, lay, on).compute_per_mb - step_time(m, job, lay, off).compute_per_mb
    assert math.isclose(extra, m.layers * moved, rel_tol=1e-9)


def test_memory_per_rank_is_that_ranks_own_sum() -> None:
    # plait's GPT (LayerNorm, GeLU, f 4h, learned positions, untied), h 64, 4 heads, V 4096,
    # s 64; pp 4 1F1B, 4 micro-batches of 1, bf16 without dropout, mixed Adam, no dp.
    m = ModelSpec(layers=4, hidden=64, heads=4, vocab=4096, seq_len=64)
    job = Job(global_batch=4, seq=64, dropout=False)
    lay = Layout(pp=4, schedule="1f1b")
    h, s, V, e = 64, 64, 4096, 2
    # one block's activations per micro-batch: two LayerNorm inputs 4e h, Q K V and the
    # projection's input 4e h, GeLU's input and fc2's 2e 4h per token; softmax e a s^2
    block = s * (4 * e * h + 4 * e * h + 2 * e * 4 * h) + e * 4 * s * s  # 163,840
    head = 2 * e * s * h + (e + 4) * s * V  # final LayerNorm input, fp32 log-softmax, logits
    acts = [4 * block, 3 * block, 2 * block, 1 * block + head]  # 1F1B: p - r in flight
    # states: 16 bytes per parameter + 4 per Adam step counter (12 tensors a block)
    params = 12 * h * h + 13 * h
    states = [
        16 * (params + V * h + s * h) + 4 * (12 + 2),  # the embedding (tokens, positions)
        16 * params + 4 * 12,
        16 * params + 4 * 12,
        16 * (params + 2 * h + V * h) + 4 * (12 + 3),  # final LayerNorm, head
    ]
    buffers = 2 * s * h * e  # the pipeline's send and receive buffers
    totals = [st + ac + buffers for st, ac in zip(states, acts, strict=True)]
    # the largest states are rank 0's, the largest activations rank 3's: their sum
    # (6,829,112 B) is no rank's; rank 3's own parts are the peak, 6,765,628 B
    assert max(states) == states[0] and max(acts) == acts[3]
    assert max(totals) == totals[3] == 6_765_628
    plan = evaluate(m, job, lay, flat(4))
    assert plan.memory_bytes == totals[3] and plan.rank == 3
    assert plan.states.total_bytes == states[3] and plan.activations.total == acts[3]
    assert plan.memory_bytes < max(states) + max(acts) + buffers
    assert [a.total for a in rank_activations(m, job, lay)] == acts
    assert [x.total_bytes for x in rank_states(m, job, lay)] == states
    text = explain(plan, m, job, flat(4))
    assert "pipeline rank 3 of 4" in text and "6.77 MB" in text
    row = breakdown(plan, flat(4))
    assert row.rank == 3 and row.needed == totals[3]


def flat(n: int):  # type: ignore[no-untyped-def]
    return replace(a100(1), devices_per_node=n, nodes=1)


def test_default_subcommand() -> None:
    assert default_subcommand(["plan", "--model", "x"]) == ["plan", "layouts", "--model", "x"]
    assert default_subcommand(["plan", "fit", "--model", "x"])[1] == "fit"
    assert default_subcommand(["plan", "--help"]) == ["plan", "--help"]


def test_plan_fit_json_and_refusals(capsys: pytest.CaptureFixture[str]) -> None:
    from plait.cli import main

    rc = main(
        [
            "plan",
            "fit",
            "--model",
            "llama3-8b",
            "--gpus",
            "8xH100",
            "--top",
            "3",
            "--json",
            "-",
            "--tp",
            "1,2",
            "--pp",
            "1",
        ]
    )
    data = json.loads(capsys.readouterr().out)
    assert rc == 0 and data["fits"] is True
    for row in data["layouts"]:
        assert math.isclose(row["headroom"], 72e9 - row["needed"])
        parts = ("parameters", "gradients", "optimizer_states", "activations")
        total = sum(row[k] for k in parts) + row["communication_buffers"]
        assert math.isclose(total, row["needed"]) and row["fits"] == (row["headroom"] >= 0)
    with pytest.raises(SystemExit):
        main(["plan", "fit", "--params", "1e30", "--gpus", "8xH100"])
    with pytest.raises(SystemExit):
        main(["plan", "fit", "--model", "gpt", "--layers", "-2"])
    err = capsys.readouterr().err
    assert "outside 1 to" in err


def test_plot_writes_a_png(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("matplotlib")
    from plait.cli import main

    out = tmp_path / "mem.png"
    rc = main(
        [
            "plan",
            "fit",
            "--model",
            "llama3-8b",
            "--gpus",
            "8xH100",
            "--top",
            "2",
            "--tp",
            "1",
            "--pp",
            "1",
            "--plot",
            str(out),
        ]
    )
    assert rc == 0 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
