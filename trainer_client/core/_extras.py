"""Which install role a missing library belongs to, said where it is missing.

``pip install ckptd`` is the jax-free core, the HTTP client and the ``ckptd`` command; ``ckptd[server]`` adds the
sidecar, ``ckptd[trainer]`` the jax runtime (docs/architecture.md, the roles). A name or a command of another role,
used without its extra, would otherwise end in a bare ``ModuleNotFoundError: No module named 'jax'``;
``needs_extra`` turns that into a ``MissingExtra`` that says what to install.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from trainer_client.core._errors import MissingExtra

OWN_PACKAGES = ("ckptd", "trainer_client")


def missing_extra(exc: ModuleNotFoundError, extra: str, what: str) -> MissingExtra:
    """The error for ``what`` failing to import a library (``exc``) that the ``extra`` install role brings."""
    name = exc.name or "?"
    return MissingExtra(f"{what} needs the {extra} install (no module {name!r} here): "
                        f"pip install 'ckptd[{extra}]'", name=exc.name)


@contextlib.contextmanager
def needs_extra(extra: str, what: str) -> Iterator[None]:
    """Inside: a third-party library that cannot be imported raises ``MissingExtra`` naming ``extra``. A missing
    module of ckptd's own packages is a broken install, not a missing extra: it passes as it is."""
    try:
        yield
    except MissingExtra:
        raise
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] in OWN_PACKAGES:
            raise
        raise missing_extra(exc, extra, what) from exc


__all__ = ["OWN_PACKAGES", "missing_extra", "needs_extra"]
