"""``ssd_engine="auto"``: which engine it picks, and why (issue 16, finding 8)."""

from __future__ import annotations

import logging

import pytest
import torch

from tba.offloaders.ssd import _engine, _kvikio


class FakeKvikio:
    """Stands in for KvikioEngine: ``gds`` says whether cuFile would really be used."""

    name = "kvikio"
    built: list[FakeKvikio] = []

    def __init__(self, gds: bool) -> None:
        self.gds = gds
        self.mode = "GPUDirect Storage through cuFile" if gds else "compat mode: cuFile unavailable"
        self.closed = False

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("gds", [False, True], ids=["compat", "gds"])
def test_auto_prefers_posix_over_kvikio_compat_mode(monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture, gds: bool) -> None:
    made: list[FakeKvikio] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_engine, "_kvikio_importable", lambda: True)
    monkeypatch.setattr(_kvikio, "KvikioEngine", lambda **kw: made.append(FakeKvikio(gds)) or made[-1])
    monkeypatch.setattr(_engine, "_log_choice", lambda name, reason: logging.getLogger("tba").warning("%s: %s", name, reason))
    with caplog.at_level(logging.WARNING, logger="tba"):
        engine = _engine.select_engine("auto", chunk_bytes=1 << 20, num_io_threads=1, num_staging_buffers=2)
    try:
        if gds:
            assert engine is made[0]
        else:
            assert engine.name == "posix" and made[0].closed
            assert any("compat mode" in r.getMessage() and "posix" in r.getMessage() for r in caplog.records)
    finally:
        if engine.name == "posix":
            engine.close()


def test_reserve_under_gds_checks_the_malloc_hook_registration(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 16, finding 11: once training is under way (the profiled step's reserve), an SSD
    offloader doing real GPUDirect Storage asks the malloc hook whether it registered enough."""
    from tba import malloc_hook
    from tba.offloaders.ssd import SSDOffloader

    calls = []
    monkeypatch.setattr(malloc_hook, "warn_if_registration_short", lambda: calls.append(1))
    off = SSDOffloader(dirs=(str(tmp_path),), engine="posix", slab_bytes=1 << 20)
    try:
        off.reserve(1 << 20)
        assert calls == []  # posix: no cuFile registration to check
        off._engine.gds = True  # as the kvikio engine under GDS
        off.reserve(1 << 20)
        assert calls == [1]
    finally:
        off.close()
