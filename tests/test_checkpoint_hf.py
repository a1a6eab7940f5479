"""``plait.checkpoint`` and Hugging Face-style files under every layout.

- ``full_state_dict`` returns the one-process model's keys and full shapes, values equal
  bitwise to the model built the same way in one process, on every rank: tensor parallel
  (Llama with grouped-query attention, GPT-2's Conv1D and fused ``c_attn`` with a tied
  head, a torchtitan-like Llama), pipeline (Llama pp 2), expert parallel (Mixtral ep 2:
  stacked experts gathered), FSDP, ZeRO-1, DDP; ``save_pretrained`` from those layouts
  writes files ``transformers``' ``from_pretrained`` loads to an equal model;
  ``parameter_counts`` gives the one-process count beside this rank's.
- ``load_pretrained`` of ``save_pretrained`` files (one file, or an index and shards;
  Mixtral's per-expert file layout) into every layout: the forward equals the one-process
  model that loaded the same files, float64; under tp, ep and FSDP each rank reads a part.
- a file of another shape, without a key or with an extra key: one error on every rank
  naming the key, both shapes and the layout, nothing loaded.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tests import checkpoint_hf_fns as fns  # noqa: E402

TOL = {"rtol": 1e-10, "atol": 1e-10}  # tp and ep sum in another order (~1e-15 seen)

FULL_CASES = [
    ("llama", "tp"),
    ("gpt2", "tp"),
    ("titan", "tp"),
    ("llama", "pipeline"),
    ("gpt2", "pipeline"),  # the tied head on the last stage: read from the embedding's key
    ("mixtral", "ep"),
    ("llama", "fsdp"),
    ("llama", "zero1"),
    ("llama", "ddp"),
]


def _from_pretrained(family: str, path: Path) -> torch.nn.Module:
    import transformers as tf

    cls = {
        "llama": tf.LlamaForCausalLM,
        "gpt2": tf.GPT2LMHeadModel,
        "mixtral": tf.MixtralForCausalLM,
    }[family]
    return cls.from_pretrained(path, dtype=torch.float64).eval()


def test_full_state_dict_and_save_pretrained_every_layout(ranks, tmp_path: Path):
    results = ranks(2, fns.full_states, FULL_CASES, str(tmp_path), timeout=300)
    for family, strategy in FULL_CASES:
        want = fns.build(family).state_dict()
        for rank, res in enumerate(results):
            got = res[f"{family}/{strategy}"]
            assert set(got) == set(want), (family, strategy, set(got) ^ set(want))
            for key, value in want.items():
                assert got[key].shape == value.shape, (family, strategy, key)
                assert torch.equal(got[key], value), (family, strategy, key, rank)
        # parameter_counts: the one-process count (tied once) and this rank's own
        whole = sum(p.numel() for p in fns.build(family).parameters())
        for res in results:
            model_count, mine = res[f"{family}/{strategy}/counts"]
            assert model_count == whole, (family, strategy, model_count, whole)
            if strategy in ("tp", "pipeline", "ep", "fsdp"):
                assert mine < whole, (family, strategy, mine, whole)
            else:
                assert mine == whole, (family, strategy, mine, whole)
        written = results[0][f"{family}/{strategy}/written"]
        assert written is not None and results[1][f"{family}/{strategy}/written"] is None
        if family == "titan":
            continue  # not a transformers model
        loaded = _from_pretrained(family, tmp_path / f"{family}-{strategy}").state_dict()
        assert set(loaded) == set(want)
        for key, value in want.items():
            assert torch.equal(loaded[key], value), (family, strategy, key)


LOAD_CASES = [
    ("llama", "tp"),
    ("gpt2", "tp"),
    ("titan", "tp"),
    ("llama", "pipeline"),
    ("mixtral", "ep"),
    ("llama", "fsdp"),
    ("llama", "zero1"),
    ("llama", "ddp"),
]


def _files(tmp_path: Path) -> dict[str, Path]:
    """Each family's perturbed model as Hugging Face writes it: Llama as an index and
    shards, GPT-2 without its tied head, Mixtral one tensor per expert; the torchtitan-like
    model through safetensors directly."""
    from safetensors.torch import save_file

    out = {}
    for family in fns.FAMILIES:
        model = fns.perturbed(family)
        path = tmp_path / family
        if family == "titan":
            path.mkdir()
            state = {k: v.contiguous() for k, v in model.state_dict().items()}
            save_file(state, str(path / "model.safetensors"))
        else:
            shard = "30KB" if family == "llama" else "50MB"
            model.save_pretrained(path, safe_serialization=True, max_shard_size=shard)
        out[family] = path
    assert (out["llama"] / "model.safetensors.index.json").is_file()
    return out


PTDP_LOAD_CASES = [("llama", "ptdp"), ("gpt2", "ptdp"), ("mixtral", "ptdp-ep")]


@pytest.mark.parametrize(
    ("world", "cases"), [(2, LOAD_CASES), (4, PTDP_LOAD_CASES)], ids=["2 ranks", "ptdp 4 ranks"]
)
def test_load_pretrained_every_layout(ranks, tmp_path: Path, world, cases):
    """Each layout reads the files (PTD-P: Llama and GPT-2 on pp 2 x tp 2, Mixtral on
    pp 2 x ep 2, each rank reading its stage's slices) and computes one process's output."""
    _check_loads(ranks, tmp_path, world, cases)


def _check_loads(ranks, tmp_path: Path, world: int, load_cases: list) -> None:
    files = _files(tmp_path)
    cases = [(f, s, str(files[f])) for f, s in load_cases]
    results = ranks(world, fns.loads, cases, timeout=300)
    x = fns.ids()
    for family, strategy in load_cases:
        # the files as transformers reads them, into the model built as on the ranks
        # (from_pretrained computes the rotary table in float64, the ranks' in float32)
        want_state = (
            fns.perturbed(family).state_dict()
            if family == "titan"
            else _from_pretrained(family, files[family]).state_dict()
        )
        oracle = fns.build(family)
        oracle.load_state_dict(want_state)
        if strategy in ("pipeline", "ptdp", "ptdp-ep"):
            # the model's own labels= loss, which transformers computes in float32 (the
            # pipeline's mean of two micro-batches' float32 losses); the state is bitwise
            want = oracle(input_ids=x, labels=x).loss.detach().double()
        else:
            want = fns.logits(oracle, x)
        for rank, res in enumerate(results):
            got = res[f"{family}/{strategy}"]
            tol = {"rtol": 1e-6, "atol": 0.0} if strategy.startswith("p") else TOL
            torch.testing.assert_close(
                got["out"], want, **tol, msg=lambda m, c=(family, strategy): f"{c}: {m}"
            )
            assert set(got["state"]) == set(want_state)
            for key, value in want_state.items():
                assert torch.equal(got["state"][key], value), (family, strategy, key, rank)
            share = got["read"] / got["total"]
            if strategy in ("ddp", "zero1"):
                assert share == 1.0, (family, strategy, share)
            else:  # this rank's slices (tp: norms and kv heads kept whole; fsdp: +row edges)
                assert share < 0.75, (family, strategy, share)


def test_load_pretrained_refuses_other_files_on_every_rank(ranks, tmp_path: Path):
    import transformers as tf
    from safetensors.torch import load_file, save_file

    base = fns.perturbed("llama")
    wide = tf.LlamaForCausalLM(tf.LlamaConfig(**{**base.config.to_dict(), "intermediate_size": 96}))
    wide.save_pretrained(tmp_path / "wide")
    base.save_pretrained(tmp_path / "base")
    state = load_file(str(tmp_path / "base" / "model.safetensors"))
    short = {k: v for k, v in state.items() if k != "model.norm.weight"}
    save_file(short, str(tmp_path / "short.safetensors"))
    save_file({**state, "model.extra.weight": torch.zeros(3)}, str(tmp_path / "extra.safetensors"))
    paths = {
        "wide": str(tmp_path / "wide"),
        "short": str(tmp_path / "short.safetensors"),
        "extra": str(tmp_path / "extra.safetensors"),
    }
    results = ranks(2, fns.refusals, paths, timeout=300)
    assert results[0] == results[1]  # the same verdict on every rank
    res = results[0]
    layout = "tensor parallel over tp(2)"
    assert "'model.layers.0.mlp.up_proj.weight': file (96, 32), model (64, 32)" in res["wide"]
    assert "'model.norm.weight': model (32,), not in the files" in res["short"]
    assert "'model.extra.weight': file (3,), not in the model" in res["extra"]
    for name in paths:
        assert layout in res[name] and "nothing was loaded" in res[name], res[name]
        assert res[f"{name}/unchanged"], name
