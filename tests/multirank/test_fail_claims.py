"""Which rank reports when several fail at once: ``dist.fail`` and the host store's claim
(the ranks share one poison word; one process's handles stand for several ranks here)."""

from __future__ import annotations

import pytest

from slidedp.errors import ConfigError, PeerFailedError, StorePoisonedError, UpdateFailedError
from slidedp.runtime import dist
from slidedp.store import GroupSpec, HostStore, ParamSpec


def _shared(monkeypatch: pytest.MonkeyPatch) -> tuple[HostStore, HostStore]:
    """The node's host store and the cpu route's signals store, as ``share_store`` keeps them."""
    host, signals = (
        HostStore.create([GroupSpec("g", [ParamSpec("w", (8,))])], staging_slots=0)
        for _ in range(2)
    )
    monkeypatch.setattr(dist, "_SHARED", [host, signals])
    return host, signals


def test_the_first_failure_reports_and_reactions_and_later_ones_do_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    host, signals = _shared(monkeypatch)
    # a rank whose collective timed out on a slow peer reacts: silent, and it claims nothing
    assert dist.fail(PeerFailedError("a collective failed")) is True
    assert dist.fail(StorePoisonedError("poisoned")) is True
    # the slow peer's own failure after it still reports (it would have been silenced)
    assert dist.fail(ConfigError("a bad token in data.jsonl:3")) is False
    assert dist.fail(ValueError("another rank's failure, later")) is True
    late = UpdateFailedError("a parameter update failed")
    late.first = 0  # its worker's claim came after another's
    assert dist.fail(late) is True
    assert dist.fail(UpdateFailedError("a parameter update failed")) is False  # first: 1
    assert not host.poison(claim=True)  # claimed
    assert signals.poison(claim=True)  # woken by every failing rank, claimed by none


def test_only_the_host_store_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    """A claim on the signals store (never made by a failing rank) does not count."""
    _, signals = _shared(monkeypatch)
    assert signals.poison(claim=True)
    assert dist.fail(RuntimeError("a rank's own failure")) is False


def test_a_failure_before_any_store_is_shared_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "_SHARED", [])
    assert dist.fail(ConfigError("no store yet")) is False
