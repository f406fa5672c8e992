"""``check_parity`` flags broken offloaders: one that corrupts one byte on one load, and ones
that silently store nothing (Note [Parity needs moved bytes])."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tba.offloaders import HostOffloader
from tba.testing import CorruptingOffloader, FakeOffloader, ForgetfulOffloader, check_parity
from tests import models
from tests.testing import factories
from tests.twin import assert_bytes_moved, run_twins

pytest.importorskip("transformers")


@pytest.mark.parametrize("inner, nth_load", [("fake", 0), ("fake", 2), ("host", 1), ("ssd", 0)])
def test_one_flipped_bit_on_one_load_is_caught(inner: str, nth_load: int, tmp_path: Path) -> None:
    if inner == "ssd":
        from tba.offloaders.ssd import SSDOffloader

        wrapped = SSDOffloader(dirs=(str(tmp_path),), engine="posix")
    else:
        wrapped = FakeOffloader() if inner == "fake" else HostOffloader()
    offloader = CorruptingOffloader(wrapped, nth_load=nth_load)
    report = check_parity(factories.gpt2(), factories.lm_batches(3), offloader=offloader, force=True)
    assert offloader.corrupted is not None and offloader.corrupted[0] == nth_load
    assert not report.ok
    assert report.first_mismatch is not None and report.first_mismatch.step == 0, str(report)
    assert report.first_mismatch.name.startswith("grad of ")
    assert 0 < report.first_mismatch.max_abs_diff < 1
    assert str(report).startswith("tba parity check: FAIL") and "differs" in str(report)


@pytest.mark.parametrize("mode", ["zeros", "untouched", "alias"])
@pytest.mark.parametrize("make", [
    pytest.param((factories.gpt2, factories.lm_batches), id="gpt2"),
    pytest.param((factories.stack, factories.vector_batches), id="stack"),
])
def test_an_offloader_that_stores_nothing_is_caught(mode: str, make) -> None:
    make_model, make_batches = make
    offloader = ForgetfulOffloader(mode)
    report = check_parity(make_model(), make_batches(3), offloader=offloader, force=True)
    assert offloader.num_stores > 0 and offloader.num_loads > 0  # the cache did use it
    assert not report.ok, str(report)
    # A wrong gradient, or an error only the model with tba raised (token ids or labels read
    # back wrong are out of range).
    assert (report.first_mismatch is not None) != (report.error is not None)
    if report.error is not None:
        assert "the model with tba raised" in report.error and report.error in report.reason


def test_the_aliasing_offloader_fools_a_plain_twin_comparison() -> None:
    """Why check_parity audits the offloader: an offloader that keeps a reference to the source
    instead of copying it out gives exact results, and the cache counts bytes as moved."""
    cache = run_twins(factories.stack, models.vector_batch,
                      steps=3, settle=True, offloader=ForgetfulOffloader("alias"),
                      offload_devices=("cpu",), min_offload_bytes=0, keep_last_modules=0, adaptive=False)
    assert_bytes_moved(cache)


def test_corrupting_offloader_flips_one_bit_of_the_nth_large_load() -> None:
    offloader = CorruptingOffloader(nth_load=1, min_bytes=100)
    data = torch.arange(256, dtype=torch.uint8).repeat(2)  # 512 bytes
    small = offloader.store(data[:10].clone())
    tokens = [offloader.store(data.clone()) for _ in range(3)]
    out = torch.empty(10, dtype=torch.uint8)
    offloader.load(small, out)  # under min_bytes: not counted, not corrupted
    assert torch.equal(out, data[:10])
    loaded = []
    for token in tokens:
        dst = torch.empty(512, dtype=torch.uint8)
        offloader.load(token, dst)
        loaded.append(dst)
    assert torch.equal(loaded[0], data) and torch.equal(loaded[2], data)
    diff = (loaded[1] != data).nonzero().flatten().tolist()
    assert diff == [257] and int(loaded[1][257] ^ data[257]) == 0x01
    assert offloader.corrupted == (1, 257)
    assert offloader.name == "corrupting(fake)"


def test_corrupting_offloader_lists_every_bad_argument() -> None:
    with pytest.raises(ValueError) as info:
        CorruptingOffloader(nth_load=-1, min_bytes=True, byte_index=-3, xor_mask=0)
    message = str(info.value)
    assert message.startswith("invalid tba.testing.CorruptingOffloader:")
    assert all(f"{name}=" in message for name in ("nth_load", "min_bytes", "byte_index", "xor_mask"))
    with pytest.raises(ValueError, match="expected an offloader to wrap"):
        CorruptingOffloader(object())  # type: ignore[arg-type]


def test_forgetful_offloader_modes() -> None:
    src = torch.arange(8, dtype=torch.uint8)
    for mode, expected in (("zeros", torch.zeros(8, dtype=torch.uint8)), ("untouched", torch.full((8,), 7, dtype=torch.uint8))):
        offloader = ForgetfulOffloader(mode)
        dst = torch.full((8,), 7, dtype=torch.uint8)
        offloader.load(offloader.store(src), dst)
        assert torch.equal(dst, expected)
    alias = ForgetfulOffloader("alias")
    token = alias.store(src)
    src.add_(1)  # it kept the source, not a copy
    dst = torch.empty(8, dtype=torch.uint8)
    alias.load(token, dst)
    assert torch.equal(dst, torch.arange(1, 9, dtype=torch.uint8))
    with pytest.raises(ValueError, match="mode='lazy': expected one of"):
        ForgetfulOffloader("lazy")  # type: ignore[arg-type]
