"""What every model of the wire contract shares: unknown fields are refused; requests are strict."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, model_validator

# The largest integer a number of the contract may be: one JSON carries exactly (a double holds integers up to
# 2**53; JavaScript, the dashboard and schema-driven tools read numbers as doubles). JSON itself allows any number
# of digits, and an unbounded integer reaches float() somewhere (metrics, goodput, plans, messages) and fails there
# as an OverflowError. Steps, counts, sizes and memory bytes are all bounded by it.
MAX_EXACT_INT = 2**53 - 1


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _integral_floats_as_ints(value: object) -> object:
    """``6.0`` -> ``6`` throughout a JSON value (bools and other floats untouched)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _integral_floats_as_ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_integral_floats_as_ints(v) for v in value]
    return value


class _Request(_Model):
    """Requests are strict: ``true`` or ``"6"`` is not a device count. JSON has one number type, so
    ``6.0`` is the integer 6 (as JSON Schema says); ``6.5`` is not."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _json_integers(cls, data: object) -> object:
        return _integral_floats_as_ints(data)


__all__ = ["MAX_EXACT_INT"]
