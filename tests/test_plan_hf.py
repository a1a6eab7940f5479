"""The planner reads Hugging Face configs: its parameter count equals the transformers
model's own, for every family it knows and every preset (built on the meta device)."""

from __future__ import annotations

import json

import pytest
import torch

from plait.plan import hf
from plait.plan.model import ModelSpec

transformers = pytest.importorskip("transformers")

TINY = dict(
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=101,
    max_position_embeddings=32,
)
CASES = {
    "llama": TINY,
    "llama-tied-bias": TINY | dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
    "mistral": TINY,
    "qwen2": TINY | dict(tie_word_embeddings=False),
    "qwen3": TINY | dict(head_dim=16, tie_word_embeddings=False),
    "mixtral": TINY | dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": TINY
    | dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=80,
        tie_word_embeddings=False,
    ),
    # a dense MLP of intermediate_size in block 1, experts in blocks 0 and 2
    "qwen2_moe-mlp-only-layers": TINY
    | dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=80,
        mlp_only_layers=[1],
    ),
    "qwen3_moe": TINY
    | dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, head_dim=16),
    "gpt2": dict(n_embd=64, n_layer=3, n_head=8, n_positions=32, vocab_size=101),
}


def _hf_count(model_type: str, options: dict) -> tuple[int, dict]:
    cfg = transformers.AutoConfig.for_model(model_type.split("-")[0], **options)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters()), cfg.to_dict()


@pytest.mark.parametrize("case", sorted(CASES))
def test_parameter_count_equals_the_transformers_model(case):
    count, cfg = _hf_count(case, CASES[case])
    spec = hf.from_hf_config(cfg)
    assert spec.num_params == count


@pytest.mark.parametrize("name", sorted(hf.PRESETS))
def test_every_preset_counts_like_its_model(name):
    options = {k: v for k, v in hf.PRESETS[name].items() if k != "model_type"}
    count, _ = _hf_count(hf.PRESETS[name]["model_type"], options)
    assert hf.load(name).num_params == count


def test_llama3_8b_is_8b_and_its_flops_follow_6n():
    spec = hf.load("llama3-8b")
    assert 8.0e9 < spec.num_params < 8.1e9
    # forward + backward ~ 6 N per token (plus attention's core, small at s = 2048)
    per_token = spec.flops_per_token(2048)
    assert 6 * spec.num_params * 0.9 < per_token < 6 * spec.num_params * 1.2


def test_a_config_file_and_unknown_families(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", **TINY}))
    assert isinstance(hf.load(str(tmp_path)), ModelSpec)
    with pytest.raises(ValueError, match="model_type 'deepseek_v3' is not one plait plans"):
        hf.from_hf_config({"model_type": "deepseek_v3"})
    with pytest.raises(ValueError, match="neither a preset"):
        hf.load(str(tmp_path / "missing.json"))


def test_plan_a_preset_on_64_h100s_from_the_command_line(capsys):
    from plait import cli

    rc = cli.main(
        ["plan", "layouts", "--model", "llama3-8b", "--gpus", "64xH100", "--batch", "512",
         "--seq", "4096", "--top", "3", "--tp", "1,2,4,8", "--pp", "1,2", "--recompute", "none",
         "--sp", "on", "--microbatch", "1,2"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    assert "model llama3-8b" in out and "8.03B parameters" in out
    assert "h100x8x8" in out


@pytest.mark.parametrize("bad", ["64", "64xV100", "12xH100"])
def test_gpus_that_are_not_whole_nodes_of_a_preset_are_refused(capsys, bad):
    from plait import cli

    rc = cli.main(["plan", "layouts", "--model", "gpt2", "--gpus", bad, "--batch", "8"])
    assert rc == 2
    assert "--gpus" in capsys.readouterr().err
