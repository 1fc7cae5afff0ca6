"""A link leading out of the root is warned about once per process, not at every refresh (docs/operations.md,
"Limits under load and hostile input"): the refresher lists every job each pass, and the warning came with
each listing (7 times in 14 s). What is remembered for it is bounded."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from ckptd.catalog._catalog import Catalog
from ckptd.catalog._refresher import Refresher
from tests.support.helpers import wait_until
from trainer_client.core._said_once import SaidOnce
from trainer_client.core._storage import Storage


def test_a_link_out_of_the_root_is_warned_about_once_over_many_refreshes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "alpha").mkdir(parents=True)
    (outside / "stepcopy").mkdir(parents=True)
    os.symlink(outside / "stepcopy", root / "alpha" / "7")  # a step directory linked to another disk
    os.symlink(outside, root / "evil")  # a job directory linked out of the root
    caplog.set_level(logging.WARNING)
    catalog = Catalog(Storage(str(root)), tmp_path / "catalog.sqlite3")
    refresher = Refresher(catalog, 0.02, full_every=1)  # every pass lists every job again
    refresher.start()
    try:
        wait_until(catalog.ready.is_set, timeout=10, what="the first scan")
        seen = {catalog.last_refresh}  # passes counted until there are ten, however long a loaded machine takes

        def ten_passes() -> bool:
            seen.add(catalog.last_refresh)
            return len(seen) > 10

        wait_until(ten_passes, timeout=60, interval=0.01, what="ten more refresh passes")
    finally:
        refresher.stop()
    job_warnings = [r.getMessage() for r in caplog.records if "job 'evil' is ignored" in r.getMessage()]
    assert len(job_warnings) == 1, job_warnings
    Catalog(Storage(str(root)), tmp_path / "again.sqlite3").refresh()  # another catalog of the same process
    link_warnings = sorted(r.getMessage() for r in caplog.records if "a link to" in r.getMessage())
    assert link_warnings == [f"ignoring {root}/alpha/7: a link to {outside}/stepcopy, outside {root}/alpha",
                             f"ignoring {root}/evil: a link to {outside}, outside {root}"]


def test_what_is_remembered_is_bounded_and_a_new_reason_is_said_again() -> None:
    said = SaidOnce(kept=100)
    assert said.first("a", "why") and not said.first("a", "why")
    assert said.first("a", "another reason")  # the same path refused for something else: said again
    for i in range(1000):
        assert said.first(f"p{i}", "why")
    assert len(said._said) == 100
    assert said.first("a", "another reason")  # forgotten long ago: said again, once
    assert not said.first("p999", "why")
