"""A pipeline plan recorded from a decoder's own forward, for layouts no family module reads.

A causal LM is ``prologue -> blocks[0..L-1] -> epilogue``: the prologue embeds the tokens
(scaled, plus learned positions, a LayerNorm: whatever the model does) and builds what the
blocks read besides the hidden states (positions, the causal and sliding-window masks,
rotary tables per attention kind, ALiBi biases); the epilogue is the final norm, the head
and whatever follows it (soft-capping, logit scales). Rather than naming these, the plan
runs the model's own forward with each block replaced by a *stand-in* that notes the
arguments the model passes it and returns the hidden states unchanged (or, for the last, the
activation the stage holds):

- **context** (per micro-batch, on every stage, never sent): the model's forward on the
  micro-batch's token ids (the first stage) or on zero embeddings of the activation's shape
  (the others), with its ``attention_mask``, stopped at the last block: every block's
  arguments, and on the first stage block 0's input (the prologue's output, with its
  gradient);
- **embed** (contextual): block 0's input from that context;
- **model.layers.<i>** (contextual): ``block(x, *args_i, **kwargs_i)``;
- **head**: the model's forward once more, the last stand-in returning ``x``: the logits
  exactly as the model computes them from the last block's output.

Which modules each layer owns is read from one recorded forward: those with parameters that
ran before block 0 (embed), after the last block (head), buffers-only ones before block 0
(the context's: rotary embeddings). Loss: ``model.loss_function`` over the whole batch's
label count (one process's mean). The plan is then proven like the Llama-layout one
(:mod:`plait.models.infer_pipeline`): the layers chained in one process give the model's own
logits and ``labels=`` loss, again with the head scaled to large logits. A forward that
feeds a block anything computed from the hidden states or the token ids (per-layer token
embeddings), calls a block twice or out of order, or adds to the loss is refused by name.

Cost per micro-batch: one forward of the prologue and of the (cheap) stand-ins on every
stage, one of the prologue and the epilogue on the last; no communication beyond the
activation.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from plait.models.llama import causal_lm_items
from plait.strategies.pipeline import Layer, PipelinePlan


class _Stop(Exception):
    """Raised by the stand-in of the last block a recording needs: the rest need not run."""


@dataclass
class _Tape:
    """What the stand-ins note and do during one recorded forward."""

    calls: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = field(default_factory=dict)
    first_input: torch.Tensor | None = None
    stop: int | None = None
    last_output: torch.Tensor | None = None  # what the last stand-in returns


@dataclass(frozen=True)
class Recorded:
    """A stage's context: each block's arguments besides the hidden states, and block 0's
    input when recorded from token ids."""

    calls: dict[int, tuple[tuple[Any, ...], dict[str, Any]]]
    first_input: torch.Tensor | None


SCALARS = (int, float, str, bool, type(None))


class _StandIn(nn.Module):
    """Stands in for block ``index`` while the model's forward is recorded."""

    def __init__(self, block: nn.Module, index: int, last: int, tape: _Tape, rest: tuple) -> None:
        super().__init__()
        # what the model's forward may read off a block (Gemma 3: attention_type)
        for name, value in vars(block).items():
            if not name.startswith("_") and name != "training" and isinstance(value, SCALARS):
                setattr(self, name, value)
        self.index, self.last, self.rest = index, last, rest
        object.__setattr__(self, "tape", tape)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden = args[0] if args else kwargs.pop("hidden_states")
        tape: _Tape = self.tape  # type: ignore[assignment]
        tape.calls[self.index] = (args[1:], kwargs)
        if self.index == 0:
            tape.first_input = hidden
        if tape.stop == self.index:
            raise _Stop
        out = (
            tape.last_output if self.index == self.last and tape.last_output is not None else hidden
        )
        return out if self.rest == () else (out, *self.rest)


@contextmanager
def _standing_in(container: nn.Module, stand_ins: list[nn.Module]) -> Iterator[None]:
    keys = list(container._modules)
    blocks = [container._modules[k] for k in keys]
    try:
        for key, stand_in in zip(keys, stand_ins, strict=True):
            setattr(container, key, stand_in)
        yield
    finally:
        for key, block in zip(keys, blocks, strict=True):
            setattr(container, key, block)


class Recorder:
    """Runs ``model``'s forward with its blocks (``container``'s children) stood in for."""

    def __init__(self, model: nn.Module, container: nn.Module, rest: tuple) -> None:
        self.model, self.container, self.rest = model, container, rest
        params = inspect.signature(model.forward).parameters
        self.takes_embeds = "inputs_embeds" in params
        self.takes_cache = "use_cache" in params

    def run(
        self,
        x: torch.Tensor,
        *,
        stop: int | None,
        last_output: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[_Tape, Any]:
        """The forward on token ids ``x`` (integer) or on zero embeddings shaped like the
        activation ``x``; the tape and the output (None when stopped)."""
        tape = _Tape(stop=stop, last_output=last_output)
        blocks = list(self.container.children())
        stands: list[nn.Module] = [
            _StandIn(b, i, len(blocks) - 1, tape, self.rest) for i, b in enumerate(blocks)
        ]
        kwargs: dict[str, Any] = {"use_cache": False} if self.takes_cache else {}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        if x.is_floating_point():
            if not self.takes_embeds:
                raise ValueError(f"{type(self.model).__name__}.forward takes no inputs_embeds")
            kwargs["inputs_embeds"] = torch.zeros_like(x)
        else:
            kwargs["input_ids"] = x
        out = None
        with _standing_in(self.container, stands):
            try:
                out = self.model(**kwargs)
            except _Stop:
                pass
        return tape, out


def _logits(out: Any) -> torch.Tensor:
    logits = getattr(out, "logits", None)
    if logits is None and isinstance(out, tuple | list):
        logits = out[0]
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"the model's forward returned {type(out).__name__} without logits")
    return logits


def _phases(
    model: nn.Module, blocks_path: str, blocks: list[nn.Module], ids: torch.Tensor
) -> tuple[dict[str, set[int]], tuple, list[int]]:
    """One real forward: for each module outside the blocks, the phases it ran in (0 before
    block 0, 1 between blocks, 2 after the last), the last block's other outputs, and the
    order the blocks were called in."""
    phase = [0]
    ran: dict[str, set[int]] = {}
    order: list[int] = []
    rest: list[tuple] = []
    inside = f"{blocks_path}."
    hooks = []
    for name, module in model.named_modules():
        if name and name != blocks_path and not name.startswith(inside):

            def note(_: nn.Module, __: Any, n: str = name) -> None:
                ran.setdefault(n, set()).add(phase[0])

            hooks.append(module.register_forward_pre_hook(note))
    for i, block in enumerate(blocks):

        def enter(_: nn.Module, __: Any, i: int = i) -> None:
            order.append(i)
            phase[0] = 1

        def leave(_: nn.Module, __: Any, out: Any, i: int = i) -> None:
            if isinstance(out, tuple) and i == len(blocks) - 1:
                rest.append(tuple(out[1:]))
            if i == len(blocks) - 1:
                phase[0] = 2

        hooks += [block.register_forward_pre_hook(enter), block.register_forward_hook(leave)]
    params = inspect.signature(model.forward).parameters
    kwargs = {"use_cache": False} if "use_cache" in params else {}
    try:
        with torch.no_grad():
            model(input_ids=ids, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    return ran, (rest[0] if rest else ()), order


def recorded_plan(
    model: nn.Module, blocks_path: str, refuse: Any, ids: torch.Tensor
) -> PipelinePlan:
    """The recorded plan (module doc), before its proof; ``refuse(model, why)`` makes the
    refusal."""
    container = model.get_submodule(blocks_path)
    blocks = list(container.children())
    n = len(blocks)
    ran, rest, order = _phases(model, blocks_path, blocks, ids)
    if order != list(range(n)):
        raise refuse(
            model,
            f"its forward calls the blocks of '{blocks_path}' in the order {order[:8]}, not "
            f"each once from 0 to {n - 1}",
        )
    # what else a block returns (attention weights) is not passed between stages: the
    # stand-ins return None there, and the proof shows the logits and loss do not need it
    rest = tuple(None for _ in rest)
    modules = dict(model.named_modules())
    owners = {n: m for n, m in modules.items() if list(m.parameters(recurse=False))}
    inside = f"{blocks_path}."
    stray = [name for name in owners if not name.startswith(inside) and name not in ran]
    if stray:
        raise refuse(model, f"module '{stray[0]}' holds parameters but never ran in a forward")
    embed = tuple((n, owners[n]) for n in owners if ran.get(n) == {0})
    head = tuple((n, owners[n]) for n in owners if ran.get(n) == {2})
    between = [n for n in owners if ran.get(n, {0}) not in ({0}, {2})]
    if between:
        raise refuse(
            model,
            f"module '{between[0]}' holds parameters and runs between the blocks or both "
            f"before and after them, so no one stage can own it",
        )
    if not head:
        raise refuse(model, "no module with parameters runs after its last block (no head)")
    # buffers-only modules the context runs (rotary tables): registered on every stage; a
    # module holding parameters anywhere below it (the base model) is not one
    context_modules = tuple(
        (name, m)
        for name, m in modules.items()
        if 0 in ran.get(name, ())
        and not any(True for _ in m.parameters())
        and any(True for _ in m.buffers(recurse=False))
    )
    recorder = Recorder(model, container, rest)
    config: Any = getattr(model, "config")  # noqa: B009

    def context(x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Recorded:
        tape, _ = recorder.run(x, stop=n - 1, attention_mask=attention_mask)
        first = tape.first_input if not x.is_floating_point() else None
        return Recorded(dict(tape.calls), first)

    def first_input(x: torch.Tensor, ctx: Recorded) -> torch.Tensor:
        assert ctx.first_input is not None
        return ctx.first_input

    def block_run(block: nn.Module, i: int) -> Any:
        def run(x: torch.Tensor, ctx: Recorded) -> torch.Tensor:
            args, kwargs = ctx.calls[i]
            out = block(x, *args, **kwargs)
            return out[0] if isinstance(out, tuple) else out  # type: ignore[no-any-return]

        return run

    def head_run(x: torch.Tensor) -> torch.Tensor:
        _, out = recorder.run(x, stop=None, last_output=x)
        return _logits(out)

    def loss(logits: torch.Tensor, labels: torch.Tensor, *, num_items: Any) -> torch.Tensor:
        return model.loss_function(  # type: ignore[operator, no-any-return]
            logits=logits, labels=labels, vocab_size=config.vocab_size, num_items_in_batch=num_items
        )

    layers = [Layer("embed", embed, first_input, contextual=True)]
    for i, block in enumerate(blocks):
        name = f"{blocks_path}.{list(container._modules)[i]}"
        layers.append(Layer(name, ((name, block),), block_run(block, i), contextual=True))
    layers.append(Layer("head", head, head_run))
    return PipelinePlan(
        layers=tuple(layers),
        loss=loss,
        reduction="items",
        items=causal_lm_items,
        context=context,
        context_modules=context_modules,
        inputs=("attention_mask",),
        shifts_labels=True,
        name=f"{type(model).__name__} (inferred: recorded from its forward)",
    )
