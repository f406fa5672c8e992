"""Models as they come: keyword inputs (``model(**batch)``) re-profile on a new shape, and a
model without blocks offloads at the granularity it has or says why it cannot."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch import nn

import tba
from tests import models
from tests.twin import assert_bytes_moved, run_twins

_ADAPTIVE = dict(offloader="host", offload_devices=("cpu",), min_offload_bytes=0,
                 adaptive=True, max_step_overhead=None, profile_step=2)


class KeywordOnly(nn.Module):
    """Takes everything by keyword, part of it nested, as Hugging Face models are called."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(models.VOCAB, 32)
        self.blocks = nn.ModuleList(models.MLPBlock(32) for _ in range(3))
        self.head = nn.Linear(32, models.VOCAB)

    def forward(self, input_ids: torch.Tensor, extras: dict | None = None,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(input_ids)
        if extras is not None:
            h = h + extras["bias"][0].mean()
        for block in self.blocks:
            h = block(h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def _batch(seq: int, nested_rows: int = 2) -> dict:
    ids = torch.randint(1, models.VOCAB, (models.BATCH, seq))
    return {"input_ids": ids, "labels": ids, "extras": {"bias": [torch.ones(nested_rows, 4)]}}


@pytest.mark.parametrize("change", ["sequence-length", "nested-tensor"])
def test_keyword_input_shapes_reprofile(change: str, caplog: pytest.LogCaptureFixture) -> None:
    model = KeywordOnly()
    changed = _batch(models.SEQ // 2) if change == "sequence-length" else _batch(models.SEQ, 3)
    batches = [_batch(models.SEQ)] * 3 + [changed]
    shape_changes = []
    with tba.configure_tensor_cache(model, **_ADAPTIVE) as cache:
        for step, batch in enumerate(batches):
            with caplog.at_level(logging.INFO, logger="tba.cache.steps.steps"):
                caplog.clear()
                loss = model(**batch)
                cache.wait_for_stores(60)  # the profiled step (2) measures completed stores
                loss.backward()
            # Only the shape change counts here: on a busy machine the measured bandwidth may
            # also move enough for a re-profile of its own.
            shape_changes += [(step, r.getMessage()) for r in caplog.records
                              if "re-profiling" in r.getMessage() and "input shapes changed" in r.getMessage()]
            if step == 2:
                assert cache.adaptive_decision is not None, cache.summary()
    assert [step for step, _ in shape_changes] == [3], shape_changes


def test_hugging_face_model_called_with_keywords(caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("transformers")
    model = models.gpt2()
    with tba.configure_tensor_cache(model, **_ADAPTIVE) as cache:
        for step, seq in enumerate((models.SEQ, models.SEQ, models.SEQ, models.SEQ // 2)):
            batch = models.lm_batch(step)
            batch = {name: value[:, :seq] for name, value in batch.items()}
            with caplog.at_level(logging.INFO, logger="tba.cache.steps.steps"):
                caplog.clear()
                loss = model(**batch).loss
                cache.wait_for_stores(60)  # the profiled step (2) measures completed stores
                loss.backward()
            if step == 2:
                assert cache.adaptive_decision is not None, cache.summary()
    assert any("input shapes changed" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------------------- no blocks
class RootOnly(nn.Module):
    """Does all the work itself: no submodules, no blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(16, 64) * 0.1)
        self.w_hidden = nn.Parameter(torch.randn(64, 64) * 0.1)
        self.w_out = nn.Parameter(torch.randn(64, 4) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ self.w_in)
        h = torch.tanh(h @ self.w_hidden)
        return (h @ self.w_out).pow(2).mean()


class LeafChildren(nn.Module):
    """No repeated blocks, only leaf modules, declared in another order than they run."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(64, 4)
        self.middle = nn.Linear(64, 64)
        self.stem = nn.Linear(16, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        h = torch.tanh(self.middle(h))
        return self.head(h).pow(2).mean()


def test_model_without_submodules_says_what_to_do() -> None:
    model = RootOnly()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tba.configure_tensor_cache(model, offloader="host", offload_devices=("cpu",),
                                        min_offload_bytes=0) as cache:
            for step in range(3):
                model(models.vector_batch(step)).backward()
            assert cache.stats(cumulative=True).offloaded_bytes == 0
    messages = [str(w.message) for w in caught if "offloaded nothing" in str(w.message)]
    assert len(messages) == 1, messages
    for expected in ("RootOnly has no submodules", "block_modules=", "keep_last_modules=0",
                     "keep_last_modules=1 keeps all 1"):
        assert expected in messages[0], messages[0]
    assert "adaptive policy" not in messages[0] and "MiB/s" not in messages[0], messages[0]


def test_model_without_submodules_offloads_its_saves() -> None:
    """keep_last_modules=0: the model's own saves are its one block, profiled and offloaded."""
    cache = run_twins(RootOnly, models.vector_batch, steps=4, settle=True,
                      keep_last_modules=0, **_ADAPTIVE)
    assert_bytes_moved(cache)
    decision = cache.adaptive_decision
    assert decision is not None and decision.num_blocks == 1
    assert decision.block_bytes[0] > 0, decision  # the profile saw the model's saves


def test_leaf_children_are_blocks_in_run_order() -> None:
    with warnings.catch_warnings():
        # The first step ran with the declared order (its tail ran first: nothing offloaded);
        # the "nothing was offloaded" warning waits for a step run in the observed order.
        warnings.simplefilter("error", UserWarning)
        cache = run_twins(LeafChildren, models.vector_batch, steps=3, settle=True,
                          offloader="host", offload_devices=("cpu",), min_offload_bytes=0,
                          adaptive=False)
    order = sorted(cache.units, key=lambda u: u.block_index)
    assert [u.name for u in order] == ["stem", "middle", "head"]
    assert_bytes_moved(cache)
