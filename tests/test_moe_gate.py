"""GShard gating on hand-computed cases, the soft-limit losses against their formulas, and
the MoE layer in one process (identity experts, draws that do not depend on how the batch
is split, balancing by the auxiliary loss and by the bias, statistics and their plot)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import plait.moe as moe
from plait.models.gpt import GPT, GPTConfig, MoEConfig
from plait.strategies.moe.gshard_gate import route


def _logits(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor([rows], dtype=torch.float64)  # one group


def test_capacity_rounds_up_and_is_capped():
    assert moe.capacity(8, 4, 1.0) == 2
    assert moe.capacity(10, 4, 1.0) == 3  # ceil(2.5)
    assert moe.capacity(10, 4, 1.25) == 4  # ceil(3.125)
    assert moe.capacity(10, 4, 1.0, min_capacity=4) == 4
    assert moe.capacity(6, 2, 4.0) == 6  # never more than S
    with pytest.raises(ValueError, match="capacity_factor must be positive"):
        moe.capacity(8, 4, 0.0)


def test_overflow_keeps_exactly_the_first_C_tokens():
    # every token prefers expert 0; S=8, E=4, cf=1 -> C=2: tokens 0 and 1 are kept
    logits = torch.zeros(1, 8, 4, dtype=torch.float64)
    logits[..., 0] = 5.0
    r = route(logits, top_k=1, capacity=moe.capacity(8, 4, 1.0))
    assert r.expert[0, :, 0].tolist() == [0] * 8
    assert r.position[0, :, 0].tolist() == list(range(8))  # exclusive cumsum
    assert r.kept[0, :, 0].tolist() == [True, True] + [False] * 6
    p0 = math.exp(5) / (math.exp(5) + 3)
    want = torch.tensor([p0, p0] + [0.0] * 6, dtype=torch.float64)
    torch.testing.assert_close(r.weight[0, :, 0], want)  # top-1: the raw probability
    assert r.kept_per_expert().tolist() == [2, 0, 0, 0]
    assert r.routed_per_expert().tolist() == [8, 0, 0, 0]


def test_top2_positions_start_after_all_first_choices():
    # E=3, S=4, C=2. First/second choices: t0 0/1, t1 1/0, t2 0/2, t3 0/1.
    # First choices: e0 gets t0 (pos 0), t2 (pos 1), t3 (pos 2: dropped); e1 gets t1 (pos 0).
    # Kept first-choice counts [2, 1, 0]; second choices start there: t0 -> e1 pos 1 (kept),
    # t1 -> e0 pos 2 (dropped), t2 -> e2 pos 0 (kept), t3 -> e1 pos 2 (dropped).
    logits = _logits([[2, 1, 0], [1, 2, 0], [2, 0, 1], [2, 1, 0]])
    r = route(logits, top_k=2, capacity=2, second_expert="all")
    assert r.expert[0].tolist() == [[0, 1], [1, 0], [0, 2], [0, 1]]
    assert r.position[0].tolist() == [[0, 1], [0, 2], [1, 0], [2, 2]]
    assert r.kept[0].tolist() == [[True, True], [True, False], [True, True], [False, False]]
    g = torch.softmax(logits[0], -1)
    w = r.weight[0]
    # kept pairs renormalised over what survived; a lone survivor weighs 1; none: 0
    torch.testing.assert_close(w[0], torch.stack([g[0, 0], g[0, 1]]) / (g[0, 0] + g[0, 1]))
    torch.testing.assert_close(w[1], torch.tensor([1.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(w[2], torch.stack([g[2, 0], g[2, 2]]) / (g[2, 0] + g[2, 2]))
    torch.testing.assert_close(w[3], torch.zeros(2, dtype=torch.float64))
    # GShard's dense combine tensor holds the same numbers at (token, expert, position)
    c = moe.combine_tensor(r)
    assert c.shape == (1, 4, 3, 2)
    assert c[0, 0, 0, 0] == w[0, 0] and c[0, 0, 1, 1] == w[0, 1] and c[0, 2, 2, 0] == w[2, 1]
    assert int((c > 0).sum()) == int(r.kept.sum()) == 5


def test_random_second_expert_is_kept_with_probability_2_g2():
    # gates [0.7, 0.3]: the second choice is kept iff u < 0.3 / 0.5 = 0.6
    logits = torch.log(torch.tensor([[[0.7, 0.3]] * 3], dtype=torch.float64))
    u = torch.tensor([[0.59, 0.61, 0.0]], dtype=torch.float64)
    r = route(logits, top_k=2, capacity=3, second_expert="random", uniform=u)
    assert r.kept[0, :, 1].tolist() == [True, False, True]
    assert r.position[0, :, 1].tolist() == [0, -1, 1]  # an undrawn choice takes no slot
    assert r.routed_per_expert().tolist() == [3, 2]
    # over many tokens the kept fraction is about 2 * g2
    G, S = 1, 20000
    logits = torch.randn(G, S, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    u = torch.rand(G, S, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    r = route(logits, top_k=2, capacity=S, second_expert="random", uniform=u)
    g = torch.softmax(logits, -1).sort(-1, descending=True).values[..., 1]
    expected = (2 * g).clamp(max=1).mean().item()
    assert abs(r.kept[..., 1].double().mean().item() - expected) < 0.01


def test_aux_losses_match_their_formulas():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 10, 4, dtype=torch.float64, generator=gen)
    r = route(logits, top_k=1, capacity=10)
    gates, first = r.gates, r.first
    G, S, E = gates.shape
    # GShard: per group mean_e(m_e * c_e / S) * E^2, averaged over groups
    want = 0.0
    for g in range(G):
        m = [sum(gates[g, s, e].item() for s in range(S)) / S for e in range(E)]
        c = [sum(int(first[g, s, e]) for s in range(S)) for e in range(E)]
        want += sum(m[e] * c[e] / S for e in range(E)) / E * E * E
    assert moe.gshard_aux_loss(gates, first).item() == pytest.approx(want / G, rel=1e-12)
    # Switch: E * sum_i f_i P_i over all tokens; equal to GShard's with one group
    T = G * S
    f = [sum(int(first[g, s, e]) for g in range(G) for s in range(S)) / T for e in range(E)]
    P = [sum(gates[g, s, e].item() for g in range(G) for s in range(S)) / T for e in range(E)]
    want_switch = E * sum(f[e] * P[e] for e in range(E))
    assert moe.switch_aux_loss(gates, first).item() == pytest.approx(want_switch, rel=1e-12)
    one = (gates.reshape(1, T, E), first.reshape(1, T, E))
    assert moe.gshard_aux_loss(*one).item() == pytest.approx(want_switch, rel=1e-12)
    # perfectly balanced routing gives 1
    flat = torch.full((1, 4, 4), 0.25, dtype=torch.float64)
    assert moe.gshard_aux_loss(flat, torch.eye(4).unsqueeze(0)).item() == pytest.approx(1.0)
    z = torch.logsumexp(logits, -1).pow(2).mean()
    assert moe.z_loss(logits).item() == pytest.approx(z.item())


def test_identity_experts_return_the_input():
    torch.manual_seed(0)
    layer = moe.MoE(
        8,
        num_experts=4,
        top_k=2,
        second_expert="all",
        capacity_factor=4.0,
        expert=nn.Identity,
        dtype=torch.float64,
    )
    x = torch.randn(3, 10, 8, dtype=torch.float64)
    torch.testing.assert_close(layer(x), x)
    # at a small capacity, a token with every choice dropped gets exactly 0
    layer.capacity_factor, layer.min_capacity = 0.5, 0
    y = layer(x)
    dropped = (y == 0).all(-1)
    assert dropped.any() and layer.last_stats is not None and layer.last_stats.dropped > 0
    torch.testing.assert_close(y[~dropped].norm(dim=-1), x[~dropped].norm(dim=-1), rtol=1, atol=0)


def test_draws_do_not_depend_on_how_the_batch_is_split():
    # one layer on 4 sequences == the same layer as two "ranks" (batch_index 0, 1) on halves
    torch.manual_seed(0)
    whole = moe.MoE(
        8, num_experts=4, capacity_factor=1.0, min_capacity=0, seed=5, dtype=torch.float64
    )
    halves = [
        moe.MoE(8, num_experts=4, capacity_factor=1.0, min_capacity=0, seed=5, dtype=torch.float64)
        for _ in range(2)
    ]
    for h in halves:
        h.load_state_dict(whole.state_dict())
    halves[1].batch_index = 1
    for _ in range(3):
        x = torch.randn(4, 6, 8, dtype=torch.float64)
        y = whole(x)
        parts = torch.cat([halves[0](x[:2]), halves[1](x[2:])])
        torch.testing.assert_close(parts, y, rtol=0, atol=1e-14)
    assert int(whole.draw_calls) == 3
    # another seed draws differently
    other = moe.MoE(
        8, num_experts=4, capacity_factor=1.0, min_capacity=0, seed=6, dtype=torch.float64
    )
    other.load_state_dict(whole.state_dict())
    x = torch.randn(16, 6, 8, dtype=torch.float64)
    assert not torch.equal(other(x), whole(x))


def _skewed_layer(**options: object) -> moe.MoE:
    torch.manual_seed(0)
    layer = moe.MoE(8, num_experts=4, top_k=1, capacity_factor=4.0, dtype=torch.float64, **options)  # type: ignore[arg-type]
    with torch.no_grad():
        layer.gate.weight.zero_()
        layer.gate.weight[0] = 1.0  # every token prefers expert 0
    return layer


def test_aux_loss_pushes_a_skewed_router_toward_balance():
    layer = _skewed_layer(aux_loss_weight=1.0)
    opt = torch.optim.SGD(layer.gate.parameters(), lr=0.5)
    x = torch.randn(8, 16, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) + 1
    imbalance, aux = [], []
    for _ in range(60):
        opt.zero_grad()
        (layer(x) * 0).sum().backward()  # only the attached aux loss has a gradient
        opt.step()
        assert layer.last_stats is not None
        imbalance.append(layer.last_stats.imbalance)
        aux.append(layer.last_stats.aux_loss)
    assert imbalance[0] == pytest.approx(4.0)  # all on one expert of 4
    # the argmax moves in jumps; over the last 10 steps the load is far more even
    assert sum(imbalance[-10:]) / 10 < 2.5, imbalance
    assert aux[-1] < 0.6 * aux[0], aux


def test_bias_balancing_steers_the_choice_only():
    torch.manual_seed(0)
    layer = moe.MoE(8, num_experts=4, top_k=1, capacity_factor=4.0, dtype=torch.float64,
                    aux_loss_weight=0.0, bias_update_rate=0.01)  # fmt: skip
    with torch.no_grad():
        layer.gate.weight.normal_(0, 0.3)
        layer.gate.weight[0] += 0.2  # expert 0 is popular
    x = torch.randn(8, 16, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) + 1
    gates_before = torch.softmax(layer.gate(x), -1)
    imbalance = []
    for step in range(60):
        layer(x)
        assert layer.last_stats is not None
        imbalance.append(layer.last_stats.imbalance)
        loads = layer.last_stats.routed_per_expert
        moe.update_expert_bias(layer)
        if step == 0:  # overloaded experts' biases fall, the others' rise
            mean = sum(loads) / 4
            want = [-0.01 if n > mean else 0.01 for n in loads]
            assert layer.expert_bias.tolist() == pytest.approx(want)
    assert imbalance[0] > 3.0
    assert sum(imbalance[-10:]) / 10 < 1.5, imbalance
    # the bias changes which experts are chosen, never the router's probabilities
    torch.testing.assert_close(torch.softmax(layer.gate(x), -1), gates_before)


def test_stats_and_plot(tmp_path):
    model = GPT(
        GPTConfig(
            vocab=13,
            layers=2,
            heads=2,
            width=8,
            seq_len=8,
            moe=MoEConfig(num_experts=4),
            moe_every=2,
        )
    )
    history = []
    for step in range(3):
        model(torch.randint(0, 13, (2, 8), generator=torch.Generator().manual_seed(step)))
        history.append(moe.collect(model))
    assert list(history[0]) == ["blocks.1.mlp"]
    s = history[-1]["blocks.1.mlp"]
    assert sum(s.routed_per_expert) == s.dropped + sum(s.tokens_per_expert)
    assert s.imbalance == max(s.routed_per_expert) / (sum(s.routed_per_expert) / 4)
    png = moe.plot_tokens_per_expert(history, tmp_path / "load.png")
    assert png.stat().st_size > 1000


def test_dense_gpt_unchanged_and_moe_blocks_placed():
    cfg = dict(vocab=13, layers=4, heads=2, width=8, seq_len=8)
    dense, with_moe = GPT(GPTConfig(**cfg)), GPT(GPTConfig(**cfg, moe=MoEConfig(), moe_every=2))
    names = [n for n, _ in dense.named_parameters()]
    assert not any("experts" in n or "gate" in n for n in names)
    moe_names = [n for n, _ in with_moe.named_parameters()]
    assert (
        "blocks.1.mlp.gate.weight" in moe_names and "blocks.3.mlp.experts.3.fc2.bias" in moe_names
    )
    assert "blocks.0.mlp.fc1.weight" in moe_names and "blocks.1.mlp.fc1.weight" not in moe_names
    assert list(moe.moe_layers(with_moe)) == ["blocks.1.mlp", "blocks.3.mlp"]


def test_bad_configuration_is_refused():
    with pytest.raises(ValueError, match="second_expert must be one of"):
        moe.MoE(8, num_experts=4, second_expert="gumbel")
    with pytest.raises(ValueError, match="top_k=2 needs at least 2 experts"):
        moe.MoE(8, num_experts=1)
    with pytest.raises(ValueError, match="groups=5 equal groups"):
        moe.MoE(8, num_experts=2, groups=5)(torch.randn(2, 6, 8))
    with pytest.raises(ValueError, match="aux_loss must be one of"):
        moe.MoE(8, num_experts=2, aux_loss="mean")
