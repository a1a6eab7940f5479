"""Tensor-parallel plans inferred for models no family knows (plait.models.infer).

Four Hugging Face families plait has no plan for (OPT, GPT-NeoX, StableLM, Gemma) and Llama's
layers under a class of one's own, handed whole to ``plait.prepare(strategy="tp")`` at tp 2:
compared with one process on the same global batch in float64 after 3 steps of 2
accumulation micro-steps with clipping active (we allow 1e-8; the ranks sum partial products
in another order). The plan inferred for LlamaForCausalLM is the hand-written one less its
"gather" entries. Refusals name the module and the plan to write."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from plait.models import infer  # noqa: E402
from plait.models.infer import PlanInferenceError, infer_tp_plan, plan_source  # noqa: E402
from plait.models.plans import plan_for  # noqa: E402
from plait.strategies.tensor import AttentionHeads, TensorPlan  # noqa: E402
from plait.strategies.tensor.parallelize import Style  # noqa: E402
from tests import plan_inference_fns as fns  # noqa: E402

TOL = {"rtol": 1e-8, "atol": 1e-8}


def test_inferred_plans_train_as_one_process(ranks):
    want = {family: fns.oracle(family) for family in fns.FAMILIES}
    for got in ranks(2, fns.train, timeout=300):
        for family, res in got.items():
            ref = want[family]
            msg = lambda m, f=family: f"{f}: {m}"  # noqa: E731
            torch.testing.assert_close(res["losses"], ref["losses"], **TOL, msg=msg)
            torch.testing.assert_close(res["norms"], ref["norms"], **TOL, msg=msg)
            assert all(n > fns.MAX_NORM for n in ref["norms"]), family  # clipping acted
            torch.testing.assert_close(res["logits0"], ref["logits0"], **TOL, msg=msg)
            assert list(res["state"]) == list(ref["state"]), family
            for key, value in ref["state"].items():
                torch.testing.assert_close(res["state"][key], value, **TOL, msg=msg)
        split = {family: set(res["split"]) for family, res in got.items()}
        # OPT: embedding and tied head split by vocabulary; attention and the block's fc1/fc2
        assert {
            "model.decoder.embed_tokens.weight",
            "model.decoder.layers.1.fc1.weight",
            "model.decoder.layers.1.self_attn.out_proj.weight",
        } <= split["opt"]
        assert "model.decoder.embed_positions.weight" not in split["opt"]  # its own forward
        # GPT-NeoX: the fused projection split as one run of heads, the untied head by vocab
        assert {"gpt_neox.layers.0.attention.query_key_value.weight", "lm_head.weight"} <= split[
            "neox"
        ]
        assert "model.layers.0.self_attn.k_proj.weight" in split["stablelm"]
        # Gemma: the scaled embedding (its own forward) and the head tied to it stay whole
        assert "model.embed_tokens.weight" not in split["gemma"]
        assert "model.layers.0.mlp.gate_proj.weight" in split["gemma"]
        # a model of one's own with an untied head: not recognisable, both left whole
        assert not {"lm_head.weight", "model.embed_tokens.weight"} & split["tiny_llama"]
        assert "model.layers.1.mlp.down_proj.weight" in split["tiny_llama"]


def _comparable(plan: TensorPlan) -> tuple[dict[str, str], AttentionHeads]:
    """Styles by kind without the "gather" entries (an optimisation: one backward
    all-reduce per block), the input="gathered" they imply and the attributes the Llama
    attention of this transformers version lacks."""
    styles = {}
    for path, style in plan.styles.items():
        style = Style(style) if isinstance(style, str) else style
        if style.kind != "gather":
            styles[path] = style if style.input != "gathered" else Style(style.kind)
    (heads,) = plan.attention
    return styles, heads


def test_inferred_llama_plan_is_the_handwritten_one(capsys):
    from transformers import LlamaForCausalLM

    from plait.models.llama import tp_plan

    torch.manual_seed(0)
    model = LlamaForCausalLM(fns.llama_config(tie_word_embeddings=False))
    inferred, written = infer_tp_plan(model), tp_plan(model)
    print("inferred:", plan_source(inferred), "hand-written:", plan_source(written), sep="\n")
    (got, got_heads), (want, want_heads) = _comparable(inferred), _comparable(written)
    assert got == want
    attn = model.model.layers[0].self_attn
    assert got_heads.modules == want_heads.modules == "model.layers.*.self_attn"
    assert (got_heads.heads, got_heads.kv_heads, got_heads.key_value) == (
        4,
        2,
        ("k_proj", "v_proj"),
    )
    assert (want_heads.heads, want_heads.kv_heads, want_heads.key_value) == (
        4,
        2,
        ("k_proj", "v_proj"),
    )
    present = {k: v for k, v in want_heads.attributes.items() if hasattr(attn, k)}
    assert dict(got_heads.attributes) == present == {"num_key_value_groups": "groups"}
    assert "AttentionHeads('model.layers.*.self_attn'" in capsys.readouterr().out


def test_plan_source_is_the_plan():
    model = fns.build("opt")
    plan = infer_tp_plan(model)
    assert eval(plan_source(plan), {**vars(infer), "Style": Style}) == plan  # noqa: S307
    fields = plan.attention[0]
    assert dict(fields.attributes) == {"embed_dim": "width", "num_heads": "heads"}


class _Adapter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.adapter = nn.Linear(32, 32)


def _refused(model: nn.Module, **options) -> str:
    with pytest.raises(ValueError) as info:
        plan_for(model, "tp", **options)
    return str(info.value)


def test_refusals_name_the_module_and_the_plan_to_write():
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    odd = fns.TinyLM(fns.llama_config(num_hidden_layers=1))
    odd.model.layers[0].mlp.scale = nn.Linear(64, 64)  # a linear no rule classifies
    text = _refused(odd)
    assert "needs plan= for a TinyLM" in text
    assert "linear 'model.layers.0.mlp.scale'" in text and "neither an attention" in text
    assert "TensorPlan(" in text and "'model.layers.*.attn.q': 'colwise'" not in text
    assert '"model.layers.*.attn.q": "colwise"' in text  # the example, in the model's paths

    # Phi-3 slices its fused qkv_proj by config.num_attention_heads: no split reproduces it
    phi3 = Phi3ForCausalLM(
        Phi3Config(
            vocab_size=fns.VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=4,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )
    )
    text = _refused(phi3)
    assert "no split of block 'model.layers.0.self_attn' cut into 2 simulated ranks" in text
    assert "'model.layers.*.self_attn.qkv_proj': 'colwise'" in text  # the plan to write
    assert "AttentionHeads('model.layers.*.self_attn', heads=4" in text

    three = fns.TinyLM(
        fns.llama_config(
            hidden_size=24, num_attention_heads=3, num_key_value_heads=3, num_hidden_layers=1
        )
    )
    with pytest.raises(
        ValueError,
        match="has 3 query heads, not divisible by the "
        "tensor-parallel size 2; choose a tensor-parallel size that divides 3",
    ):
        infer_tp_plan(three, tp=2)
    with pytest.raises(
        ValueError,
        match=r"linear 'model.layers.\*.mlp.gate_proj' \(colwise\) "
        "has 64 outputs, not divisible by the tensor-parallel size 3",
    ):
        infer_tp_plan(three)  # proven at tp 3 by default: the MLP's 64 do not divide
    three = fns.TinyLM(
        fns.llama_config(
            hidden_size=24,
            num_attention_heads=3,
            intermediate_size=48,
            num_key_value_heads=3,
            num_hidden_layers=1,
        )
    )
    assert infer_tp_plan(three).attention[0].heads == 3

    text = _refused(fns.tiny_llama(), sequence_parallel=True)
    assert "sequence parallelism is not inferred" in text
    assert plan_for(fns.tiny_llama(), "tp", mode="2d") is None
    assert isinstance(PlanInferenceError("x"), ValueError)
