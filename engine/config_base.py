"""Shared building blocks of the engine config models (`engine/config*.py`).

Holds the base class every config section derives from, the `ConfigError` raised by
`deepfleet.engine.config.load_config`, and the number/bool types the sections use. The types are
stricter than pydantic's lax mode where a JSON config needs it (a bool is never a number, a string
is never a number or a bool) and looser where DeepSpeed configs need it (`2e8` is a valid integer,
because JSON writers emit bucket sizes in exponent notation). Torch-free.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict


class ConfigError(ValueError):
    """An engine config that cannot be used; `.errors` holds one line per problem.

    Each line reads ``"<dotted.key>: <problem>; <fix>"``. `str(error)` joins them with newlines.
    """

    def __init__(self, errors: list[str]) -> None:
        self.errors = list(errors)
        super().__init__("\n".join(self.errors))


class ConfigSection(BaseModel):
    """Base of every config section: unknown keys are errors, field docstrings become descriptions."""

    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        populate_by_name=True,
        validate_assignment=False,
    )


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def _integer(value: Any) -> Any:
    """Accept ints and integral floats (``2e8``); reject bools and strings with a fix."""
    if isinstance(value, bool):
        raise ValueError(f"expected an integer, got {_describe(value)}; write a number without quotes")
    if isinstance(value, float):
        if value.is_integer():
            return int(value)
        raise ValueError(f"expected an integer, got {value!r}; use a whole number")
    if not isinstance(value, int):
        raise ValueError(f"expected an integer, got {_describe(value)}; write a number without quotes")
    return value


def _number(value: Any) -> Any:
    """Accept finite ints and floats; reject bools, strings, NaN and infinities with a fix."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected a number, got {_describe(value)}; write a number without quotes")
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {value!r}; write a finite number")
    return float(value)


def _boolean(value: Any) -> Any:
    """Accept only true/false (JSON booleans); `"yes"` or 1 are rejected, not guessed."""
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {_describe(value)}; write true or false without quotes")
    return value


Int = Annotated[int, BeforeValidator(_integer)]
Float = Annotated[float, BeforeValidator(_number)]
Bool = Annotated[bool, BeforeValidator(_boolean)]


def _betas(value: Any) -> Any:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ValueError(f"expected two numbers [beta1, beta2], got {_describe(value)}; write e.g. [0.9, 0.999]")
    for beta in value:
        _number(beta)
        if not 0.0 <= float(beta) < 1.0:
            raise ValueError(f"each beta must be in [0, 1), got {list(value)}; write e.g. [0.9, 0.999]")
    return (float(value[0]), float(value[1]))


Betas = Annotated[tuple[float, float], BeforeValidator(_betas)]


def _rates(value: Any) -> Any:
    """A learning rate, or one per param group (DeepSpeed's warmup and range-test schedules accept lists)."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError("expected a number or a non-empty list of numbers, got []; write one rate per param group")
        return [_rates(v) for v in value]
    rate = _number(value)
    if rate < 0:
        raise ValueError(f"must be >= 0, got {value!r}; set a non-negative learning rate")
    return rate


PerGroupRate = Annotated[float | list[float], BeforeValidator(_rates)]
