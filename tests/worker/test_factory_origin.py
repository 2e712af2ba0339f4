"""A factory is the job's own code: a module from the Python installation (standard library,
site-packages) is refused before it is imported, unless the admin allow-listed its prefix."""

from __future__ import annotations

import pytest

from deepfleet.worker.spec import FACTORY_MODULES_ENV, WorkerSpecError
from deepfleet.worker.train import _check_factory_origin


@pytest.mark.parametrize("module", ["os", "subprocess", "builtins", "sys", "json.decoder", "torch.nn"])
def test_installed_modules_are_not_factories(module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FACTORY_MODULES_ENV, raising=False)
    with pytest.raises(WorkerSpecError, match="is not the job's own code"):
        _check_factory_origin(module)


def test_the_jobs_own_code_and_allow_listed_prefixes_are(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FACTORY_MODULES_ENV, raising=False)
    _check_factory_origin("examples.gpt.factories")  # the repository's code, not an installed package
    monkeypatch.setenv(FACTORY_MODULES_ENV, "torch.nn,other")
    _check_factory_origin("torch.nn.modules")
    with pytest.raises(WorkerSpecError):
        _check_factory_origin("torch.optim")
