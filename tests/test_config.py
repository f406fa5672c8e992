"""Configuration ergonomics: ``configure_tensor_cache(model, config=...)`` and one string where a
tuple is expected."""

from __future__ import annotations

import pytest
import torch

import tba
from tests import models

_CPU = dict(offload_devices=("cpu",), min_offload_bytes=0, adaptive=False, keep_last_modules=0)


def _one_step(model: torch.nn.Module, cache: tba.TensorCache) -> tba.CacheStats:
    """One forward, every store completed, one backward: the step's stats."""
    loss = model(models.vector_batch(0))
    cache.wait_for_stores(timeout_s=30)
    loss.backward()
    return cache.stats()


def test_a_string_is_one_item_of_a_tuple_option() -> None:
    cfg = tba.TensorCacheConfig(
        offload_devices="cpu", skip_modules="lm_head", block_modules="blocks.*", ssd_dirs="/d"
    )
    assert cfg.offload_devices == ("cpu",)
    assert cfg.skip_modules == ("lm_head",)
    assert cfg.block_modules == ("blocks.*",)
    assert cfg.ssd_dirs == ("/d",)
    assert cfg == tba.TensorCacheConfig(
        offload_devices=("cpu",), skip_modules=("lm_head",), block_modules=("blocks.*",),
        ssd_dirs=("/d",),
    )


def test_a_bad_string_is_still_reported() -> None:
    with pytest.raises(ValueError, match=r"offload_devices=\('gpu',\)"):
        tba.TensorCacheConfig(offload_devices="gpu")


@pytest.mark.timing
def test_string_options_take_effect_in_training() -> None:
    """``offload_devices="cpu"`` makes CPU training offload, and ``skip_modules="blocks.1"``
    skips exactly what the one-item tuple skips."""
    offloaded = {}
    for label, skip in (("none", ()), ("str", "blocks.1"), ("tuple", ("blocks.1",))):
        torch.manual_seed(0)
        model = models.Stack(num_blocks=3)
        options = dict(_CPU, offload_devices="cpu", skip_modules=skip)
        with tba.configure_tensor_cache(model, **options) as cache:
            offloaded[label] = _one_step(model, cache).offloaded_bytes
    assert offloaded["none"] > 0, offloaded
    assert 0 < offloaded["str"] == offloaded["tuple"] < offloaded["none"], offloaded


@pytest.mark.timing
def test_config_object_is_accepted() -> None:
    torch.manual_seed(0)
    model = models.Stack(num_blocks=3)
    cfg = tba.TensorCacheConfig(offloader="host", **_CPU)
    with tba.configure_tensor_cache(model, config=cfg) as cache:
        assert cache.config is cfg
        stats = _one_step(model, cache)
    assert stats.offloaded_bytes > 0 and stats.reloaded_bytes > 0, stats
    # Positional, as torchao's quantize_(model, config); keywords that agree are fine.
    with tba.configure_tensor_cache(model, cfg, min_offload_bytes=0) as cache:
        assert cache.config == cfg


def test_config_and_disagreeing_keywords_are_refused() -> None:
    cfg = tba.TensorCacheConfig(offload_devices="cpu", min_offload_bytes=0)
    with pytest.raises(ValueError) as info:
        tba.configure_tensor_cache(
            models.Stack(), config=cfg, offload_devices="cuda", min_offload_bytes=7, bogus=1
        )
    message = str(info.value)
    for expected in (
        "offload_devices=('cuda',) as a keyword, but config has offload_devices=('cpu',)",
        "min_offload_bytes=7 as a keyword, but config has min_offload_bytes=0",
        "config.replace(",
        "bogus: unknown option",
    ):
        assert expected in message, (expected, message)


def test_config_of_the_wrong_type_is_refused() -> None:
    with pytest.raises(ValueError, match="expected a tba.TensorCacheConfig"):
        tba.configure_tensor_cache(models.Stack(), config={"offloader": "host"})  # type: ignore[arg-type]
