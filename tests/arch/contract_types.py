"""An import-linter contract type for forbidden contracts with exceptions: `forbidden_matching`.

Registered in pyproject.toml (`contract_types`) and loaded by `lint-imports` (run from the repo root,
so this module is importable; `make lint` and tests/arch/test_import_contracts.py do that). Why our
own: a built-in `forbidden` contract takes literal module names or `*`/`**` wildcards over whole
name segments, so it cannot say "all of `deepfleet.engine` except `engine.config*`" without a
hand-kept list of every other module (stale the day someone adds one), and ignoring the allowed
imports instead would also hide chains that run through them (controller -> engine.config ->
engine.optim -> torch).

`source_modules` and `forbidden_modules` are lists of patterns: a name means that module and every
module inside it; `*` and `?` match within names as in `fnmatch` (`deepfleet.engine.config*`); a
leading `!` removes what the pattern matches from what the earlier entries selected. The expanded
names are checked as single modules (`as_packages = false`) by import-linter's own forbidden
contract, indirect imports included, so its report and options (`ignore_imports`, ...) are unchanged.
"""

from __future__ import annotations

import fnmatch

from grimp import ImportGraph
from importlinter.contracts.forbidden import ForbiddenContract
from importlinter.domain import fields
from importlinter.domain.contract import ContractCheck
from importlinter.domain.imports import ModuleExpression


def expand(patterns: list[str], graph: ImportGraph) -> set[str]:
    """The module names the patterns select, in order (`!` entries remove)."""
    modules = graph.modules
    internal_roots = {m.split(".")[0] for m in modules if not graph.is_module_squashed(m)}
    selected: set[str] = set()
    for raw in patterns:
        exclude, pattern = raw.startswith("!"), raw.removeprefix("!")
        matched = {m for m in modules if fnmatch.fnmatchcase(m, pattern) or fnmatch.fnmatchcase(m, pattern + ".*")}
        if not matched and not exclude and pattern.split(".")[0] in internal_roots:
            raise ValueError(f"{raw!r} matches no module")  # a typo; an external package may be unused
        selected = selected - matched if exclude else selected | matched
    return selected


class ForbiddenMatchingContract(ForbiddenContract):
    """A forbidden contract whose module lists are patterns with `!` exceptions (module docstring)."""

    type_name = "forbidden_matching"

    source_modules = fields.ListField(subfield=fields.StringField())
    forbidden_modules = fields.ListField(subfield=fields.StringField())

    def check(self, graph: ImportGraph, verbose: bool) -> ContractCheck:
        sources = expand(list(self.source_modules), graph)
        forbidden = expand(list(self.forbidden_modules), graph)
        self.source_modules = [ModuleExpression(name) for name in sorted(sources)]
        self.forbidden_modules = [ModuleExpression(name) for name in sorted(forbidden)]
        self.as_packages = False
        return super().check(graph, verbose)
