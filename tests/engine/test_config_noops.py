"""The no-op table (`engine/config_noops.py`), the docs and the code agree: every config field that no
engine or worker code reads is documented as a no-op with its reason, no documented no-op is read,
and `docs/engine.md` lists exactly the table's keys."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from deepfleet.engine.config import ConfigError, DeepFleetConfig, load_config
from deepfleet.engine.config_keys import NOT_SUPPORTED, _models_in
from deepfleet.engine.config_noops import NO_OPS

ROOT = Path(__file__).resolve().parents[2]


def _nested(annotation: object) -> list[type[BaseModel]]:
    """The models inside an annotation, also as values of dicts and lists (`dict[str, Group]` -> "*")."""
    found = list(_models_in(annotation))
    for arg in typing.get_args(annotation):
        if not found or typing.get_origin(annotation) in (dict, list):
            found += [m for m in _nested(arg) if m not in found]
    return found


def _leaves(model: type[BaseModel], path: str = "") -> set[str]:
    out: set[str] = set()
    for name, field in model.model_fields.items():
        direct = _models_in(field.annotation)
        subs = direct or _nested(field.annotation)
        if not subs:
            out.add(path + name)
        for sub in subs:
            out |= _leaves(sub, f"{path}{name}." if sub in direct else f"{path}{name}.*.")
    return out


def _code() -> tuple[str, str]:
    """(code, config code): every engine/worker/kernels module except the config models, and the config
    models, whose validators and properties may read their own fields."""
    files = [p for top in ("engine", "worker", "kernels") for p in (ROOT / top).rglob("*.py")]
    # code that is torch-free and named like a section (so the controller may import it): the degree table
    # the mesh reads, and the elastic batch arithmetic load_config applies
    logic = {"config_parallel.py", "config_batch_elasticity.py"}
    code = [p for p in files if not p.name.startswith("config") or p.name in logic]
    sections = [p for p in files if p.name.startswith("config") and p.name not in logic]
    return "\n".join(p.read_text() for p in code), "\n".join(p.read_text() for p in sections)


def _read(leaf: str, code: tuple[str, str]) -> bool:
    name = re.escape(leaf.rsplit(".", 1)[-1])
    # code: an attribute, a quoted key, or a keyword parameter fed by a section's model_dump();
    # config models: a validator or property reading its own field (declarations do not count)
    return (re.search(rf"\.{name}\b|[\"']{name}[\"']|\b{name}\s*(:|=(?!=))", code[0]) is not None
            or re.search(rf"\bself\.{name}\b", code[1]) is not None)


# Fields whose validators refuse every value but DeepSpeed's default unless device is nvme (or at all,
# "not supported yet"): not silent.
REFUSED_UNLESS_DEFAULT = {
    **{f"zero_optimization.offload_optimizer.{k}": v for k, v in [("ratio", 0.5)]},
    **{f"zero_optimization.offload_param.{k}": v for k, v in [
        ("nvme_path", "/nvme"), ("buffer_count", 8), ("buffer_size", 10), ("max_in_cpu", 10)]},
}


# NVMe-only keys: refused at other values unless device is nvme.
NVME_ONLY = {
    **{f"zero_optimization.offload_optimizer.{k}": v for k, v in [
        ("nvme_path", "/nvme"), ("buffer_count", 8), ("pipeline_read", True), ("pipeline_write", True),
        ("fast_init", True)]},
}


def test_fields_that_only_take_their_default_are_refused_at_other_values() -> None:
    for key, value in {**REFUSED_UNLESS_DEFAULT, **NVME_ONLY}.items():
        section, sub, leaf = key.split(".")
        config = {"train_batch_size": 2, section: {"stage": 3, sub: {"device": "cpu", leaf: value}}}
        with pytest.raises(ConfigError) as e:
            load_config(config)
        assert any(line.startswith(key + ":") for line in e.value.errors), (key, e.value.errors)


def test_every_unread_field_is_a_documented_no_op_and_no_no_op_is_read() -> None:
    code, leaves = _code(), _leaves(DeepFleetConfig)
    unread = {leaf for leaf in leaves if not _read(leaf, code)} - set(REFUSED_UNLESS_DEFAULT)
    everywhere = {k for k, v in NO_OPS.items() if v.stages is None and k in leaves}
    assert unread - everywhere == set(), f"read by no code: implement, or add to config_noops.NO_OPS: {sorted(unread - everywhere)}"
    # a name that several sections share (dense_ratio) is read somewhere; only unique names are decidable
    names = [leaf.rsplit(".", 1)[-1] for leaf in leaves]
    unique = {k for k in everywhere if names.count(k.rsplit(".", 1)[-1]) == 1}
    assert unique - unread == set(), f"now read by code: delete from config_noops.NO_OPS: {sorted(unique - unread)}"


def test_no_ops_that_are_not_fields_are_accepted_at_any_value() -> None:
    leaves = _leaves(DeepFleetConfig)
    for key in set(NO_OPS) - leaves:
        assert key in NOT_SUPPORTED, key
        assert all(NOT_SUPPORTED[key].harmless(v) for v in (True, False, 0, 123, "x")), key


def test_docs_list_exactly_the_no_ops() -> None:
    text = (ROOT / "docs" / "engine.md").read_text()
    section = text.split("### Accepted keys that change nothing", 1)[1].split("\n#", 1)[0]
    documented = re.findall(r"^\| `([A-Za-z0-9_.]+)` \| ([0-9, a-z]+) \| (.+) \|$", section, flags=re.M)
    expected = [(k, "all" if v.stages is None else ", ".join(map(str, v.stages)), v.reason) for k, v in NO_OPS.items()]
    assert documented == expected, "docs/engine.md's no-op table must be config_noops.NO_OPS, row for row"


def test_stage3_gather_16bit_weights_on_model_save_is_read() -> None:
    assert "zero_optimization.stage3_gather_16bit_weights_on_model_save" not in NO_OPS
    assert _read("stage3_gather_16bit_weights_on_model_save", _code())
