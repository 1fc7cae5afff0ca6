"""The base of ckptd's settings groups: one group per concern (storage, the memory tier, peers, limits, auth, ...),
each defined beside the part that uses it and composed into ``Settings`` by ``ckptd/config.py``.

A group reads the same ``CKPTD_*`` variables the flat settings always read (prefix ``CKPTD_`` and the field's
name), so splitting the settings into groups renamed no variable. Only the composition root builds them, once
(``ckptd serve``: ``ckptd/cli/_serve.py``), and hands each part its group; no module reads the environment again.
The group modules import nothing of the parts beside them, so the shared layer can compose them
(docs/architecture.md, "Package map").
"""

from __future__ import annotations

from pathlib import Path

from pydantic_settings import BaseSettings, SettingsConfigDict

# The value deploy/k8s/secret.example.yaml shows; a token or peer secret starting like it was copied, not generated.
PLACEHOLDER_TOKEN_PREFIX = "REPLACE-WITH"


class SettingsGroup(BaseSettings):
    """One group of ckptd's settings, read from ``CKPTD_<FIELD>``."""

    # hide_input_in_errors: a validation error must never print a token or secret it was given.
    # populate_by_name: tests and callers give host_index/host_count by name; the environment by their aliases.
    model_config = SettingsConfigDict(env_prefix="CKPTD_", extra="ignore", hide_input_in_errors=True,
                                      populate_by_name=True)


def read_secret(path: str, what: str) -> str:
    """The secret in the file ``path`` (a mounted Secret), whitespace stripped; ``ValueError`` naming ``what`` when
    it cannot be read (never the secret itself)."""
    try:
        return Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {what}: {exc}") from None


__all__ = ["PLACEHOLDER_TOKEN_PREFIX", "SettingsGroup", "read_secret"]
