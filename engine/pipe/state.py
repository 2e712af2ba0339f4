"""Checkpoint state of one pipeline stage, in the layout of the whole model.

Used by `engine/pipe/engine.py`, which puts `StageState` in place of `engine.sharding` for what
`engine/checkpoint/` reads (the checkpoint layer itself is unchanged). Tensors need nothing: parameter
names are the same at every pipeline depth (`module.py`), every stage saves the entries it holds, and
DCP writes each key once and lets any layout read it. The optimizer's `param_groups` are the one
non-tensor entry whose value differs between stages (each lists its own parameters) and DCP keeps one
rank's copy, so here every stage saves the union over the pipeline (stage order) and, on load, keeps
the names it holds before the strategy checks them against its optimizer.
"""

from __future__ import annotations

from typing import Any

from deepfleet.engine import comm


class StageState:
    """A ZeroStrategy whose state dicts cover the whole pipeline (module docstring); everything else
    is the wrapped strategy's."""

    def __init__(self, inner: Any, *, module: Any, pp_group: Any) -> None:
        self.inner = inner
        self._own = {name for name, p in module.named_parameters() if p.requires_grad}
        self._group = pp_group

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def state_dict(self) -> dict:
        state = self.inner.state_dict()
        groups = state.get("optim", {}).get("param_groups", [])
        mine = [list(g["params"]) for g in groups]
        every: list[Any] = [None] * comm.get_world_size(self._group)
        comm.all_gather_object(every, mine, group=self._group)
        merged = []
        for i, group in enumerate(groups):
            names: list[str] = []
            for stage_groups in every:
                names += [n for n in stage_groups[i] if n not in names]
            merged.append({**group, "params": names})
        if groups:
            state["optim"]["param_groups"] = merged
        return state

    def load_state_dict(self, state: dict) -> None:
        optim = state.get("optim")
        if isinstance(optim, dict) and optim.get("param_groups"):
            optim["param_groups"] = [{**g, "params": [n for n in g["params"] if n in self._own]}
                                     for g in optim["param_groups"]]
        self.inner.load_state_dict(state)
