"""The bit-exact models and the adversarial suite through the strict CPU model of the GPU's
ordering rules (tests/cache/strict.py): no store before its producer event, loads ordered
after their buffer's allocation on the producer's stream, every reloaded tensor consumed after
its load event, no transfer under the cache's lock."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import models
from tests.cache import test_adversarial as adversarial
from tests.cache.strict import strict_model
from tests.twin import assert_bytes_moved, run_twins

CASES = [
    pytest.param(models.Stack, models.vector_batch, id="stack"),
    pytest.param(adversarial.FusedQKV, adversarial.feat_batch(32), id="fused-qkv-views"),
    pytest.param(adversarial.SharedSaver, adversarial.feat_batch(16), id="shared-saver"),
    pytest.param(adversarial.InPlace, adversarial.feat_batch(16), id="in-place"),
    pytest.param(lambda: adversarial.Checkpointed(True), adversarial.feat_batch(16), id="checkpoint-reentrant"),
    pytest.param(lambda: adversarial.Checkpointed(False), adversarial.feat_batch(16), id="checkpoint-non-reentrant"),
]


def options(offloader: str, tmp_path: Path) -> dict:
    out = dict(offloader=offloader, offload_devices=("cpu",), min_offload_bytes=0,
               keep_last_modules=0, adaptive=False)
    if offloader == "ssd":
        out.update(ssd_dirs=(str(tmp_path),), ssd_engine="posix")
    return out


@pytest.mark.parametrize("make_model, make_batch", CASES)
@pytest.mark.parametrize("offloader", ["host", "ssd"])
def test_bit_exact_under_the_strict_model(make_model, make_batch, offloader: str, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    with strict_model(monkeypatch) as violations:
        cache = run_twins(make_model, make_batch, steps=3, settle=True, **options(offloader, tmp_path))
        assert_bytes_moved(cache)
    assert violations == []


def test_gpt2_under_the_strict_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    with strict_model(monkeypatch) as violations:
        cache = run_twins(models.gpt2, models.lm_batch, steps=3, settle=True, **options("host", tmp_path))
        assert_bytes_moved(cache)
    assert violations == []


def test_the_strict_model_catches_a_store_that_ignores_its_event(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model is not a rubber stamp: a cache whose stores skip the producer event fails."""
    from tba.cache.engine.core import Engine

    real_transfer = Engine._store_worker

    def patched(self):  # stores wait on nothing
        original = self.streams.transfer
        self.streams.transfer = lambda device, kind, wait_for: original(device, kind, None if kind == "store" else wait_for)
        return real_transfer(self)

    monkeypatch.setattr(Engine, "_store_worker", patched)
    with strict_model(monkeypatch) as violations:
        run_twins(models.Stack, models.vector_batch, steps=1, settle=True, **options("host", Path(".")))
    assert any("did not wait on its producer event" in v for v in violations)
