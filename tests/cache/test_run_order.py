"""Blocks are numbered in the order they run, not as declared (Note [Blocks in run order] in
tba/cache/capture/run_order.py): the kept tail is the last block to run."""

from __future__ import annotations

import collections
from collections.abc import Callable

import pytest
import torch
from torch import nn

import tba
from tba.cache.observe.clock import default_clock
from tba.cache.policy.profile import StepProfile
from tba.cache.steps.scopes import Unit
from tba.testing import probe
from tests import models
from tests.twin import assert_bytes_moved, run_twins

_CPU = dict(offload_devices=("cpu",), min_offload_bytes=0, adaptive=False)


def _block_order(cache: tba.TensorCache) -> list[str]:
    blocks = [u for u in cache.units if u.block_index is not None]
    return [u.name for u in sorted(blocks, key=lambda u: u.block_index)]


class Scheduled(nn.Module):
    """Runs its blocks in ``schedule`` order (indices into the declared list)."""

    def __init__(self, schedule: tuple[int, ...], num_blocks: int = 4) -> None:
        super().__init__()
        self.schedule = schedule
        self.embed = nn.Linear(16, 64)
        self.blocks = nn.ModuleList(models.MLPBlock(64) for _ in range(num_blocks))
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for index in self.schedule:
            h = self.blocks[index](h)
        return self.head(h).pow(2).mean()


def _offloaded_by_unit(cache: tba.TensorCache, saves: list) -> dict[str, set[bool]]:
    out: dict[str, set[bool]] = collections.defaultdict(set)
    for save in saves:
        if save.new_entry and save.units:
            out[save.units[0]].add(save.offloaded)
    return out


def _watch_step(step: int, out: list) -> Callable[[tba.TensorCache], None]:
    """An ``on_configure`` that records, into ``out[1]``, the saves of the model's ``step``-th
    forward (1-based)."""

    def configure(cache: tba.TensorCache) -> None:
        view = probe(cache)
        count = [0]

        def pre(module: nn.Module, args: tuple) -> None:
            count[0] += 1
            if count[0] == step:
                context = view.watch_saves()
                out.extend((context, context.__enter__()))

        def post(module: nn.Module, args: tuple, output: object) -> None:
            if count[0] == step:
                out[0].__exit__(None, None, None)

        model = cache.model
        assert model is not None
        model.register_forward_pre_hook(pre, prepend=True)
        model.register_forward_hook(post)

    return configure


@pytest.mark.parametrize(
    "schedule, expected",
    [
        ((3, 2, 1, 0), ["blocks.3", "blocks.2", "blocks.1", "blocks.0"]),
        # Block 2 runs first and again last: its first run places it; block 1 is the tail.
        ((2, 0, 1, 2), ["blocks.3", "blocks.2", "blocks.0", "blocks.1"]),
    ],
    ids=["reversed", "one-block-twice"],
)
def test_blocks_declared_in_another_order_than_they_run(schedule: tuple, expected: list) -> None:
    watched: list = []
    configure = _watch_step(2, watched)
    cache = run_twins(lambda: Scheduled(schedule), models.vector_batch, steps=3, settle=True,
                      on_configure=configure, **_CPU)
    assert _block_order(cache) == expected
    assert_bytes_moved(cache)
    by_unit = _offloaded_by_unit(cache, watched[1])
    assert by_unit[expected[-1]] == {False}, by_unit  # the last block to run stays in memory
    ran_once = [name for name in expected[:-1] if schedule.count(int(name[-1])) == 1]
    assert all(by_unit[name] == {True} for name in ran_once), by_unit
    assert by_unit["head"] == {False}  # runs after the tail


class EncoderDecoder(nn.Module):
    """Declares its decoder first; runs the encoder first."""

    def __init__(self) -> None:
        super().__init__()
        self.decoder = nn.ModuleList(models.MLPBlock(32) for _ in range(2))
        self.encoder = nn.ModuleList(models.MLPBlock(32) for _ in range(2))
        self.embed = nn.Linear(16, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        memory = self.embed(x)
        for block in self.encoder:
            memory = block(memory)
        h = memory
        for block in self.decoder:
            h = block(h) + memory
        return self.head(h).pow(2).mean()


def test_encoder_declared_after_its_decoder() -> None:
    watched: list = []
    cache = run_twins(EncoderDecoder, models.vector_batch, steps=3, settle=True,
                      on_configure=_watch_step(2, watched), **_CPU)
    assert _block_order(cache) == ["encoder.0", "encoder.1", "decoder.0", "decoder.1"]
    by_unit = _offloaded_by_unit(cache, watched[1])
    assert by_unit["decoder.1"] == {False}
    assert by_unit["encoder.0"] == by_unit["encoder.1"] == by_unit["decoder.0"] == {True}
    assert_bytes_moved(cache)


def test_t5_encoder_decoder() -> None:
    pytest.importorskip("transformers")
    watched: list = []
    cache = run_twins(models.t5, models.t5_batch, steps=2, settle=True,
                      on_configure=_watch_step(2, watched), **_CPU)
    assert _block_order(cache) == [
        "encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"]
    by_unit = _offloaded_by_unit(cache, watched[1])
    assert by_unit["decoder.block.1"] == {False}
    assert True in by_unit["encoder.block.0"] and True in by_unit["decoder.block.0"]
    assert_bytes_moved(cache)


def _clip() -> nn.Module:
    from transformers import CLIPConfig, CLIPModel

    config = CLIPConfig(
        text_config=dict(vocab_size=models.VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4,
                         max_position_embeddings=models.SEQ),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, image_size=16, patch_size=8),
        projection_dim=16,
    )
    return CLIPModel(config)


def _clip_batch(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(1, models.VOCAB, (models.BATCH, models.SEQ), generator=g),
        "pixel_values": torch.randn(models.BATCH, 3, 16, 16, generator=g),
        "return_loss": True,
    }


def test_clip_dual_tower_keeps_the_last_block_to_run() -> None:
    """CLIP declares its text tower first and runs it last: the kept tail is the text tower's
    last layer, not the vision tower's (declared last, run in the middle)."""
    pytest.importorskip("transformers")
    watched: list = []
    cache = run_twins(_clip, _clip_batch, steps=2, settle=True,
                      on_configure=_watch_step(2, watched), **_CPU)
    order = _block_order(cache)
    assert order == [
        "vision_model.encoder.layers.0", "vision_model.encoder.layers.1",
        "text_model.encoder.layers.0", "text_model.encoder.layers.1",
    ], order
    by_unit = _offloaded_by_unit(cache, watched[1])
    assert by_unit["text_model.encoder.layers.1"] == {False}
    for name in order[:-1]:
        assert True in by_unit[name], (name, by_unit)
    assert_bytes_moved(cache)


def test_run_order_observed_again_with_each_profile() -> None:
    """A model whose path depends on the input shape: the adaptive re-profile after a shape
    change observes the new order."""

    class ShapeDependent(Scheduled):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.schedule = (0, 1, 2, 3) if x.shape[0] == 8 else (3, 2, 1, 0)
            return super().forward(x)

    model = ShapeDependent((0, 1, 2, 3))
    orders = []
    with tba.configure_tensor_cache(model, offloader="host", offload_devices=("cpu",),
                                    min_offload_bytes=0, adaptive=True, max_step_overhead=None,
                                    profile_step=2) as cache:
        for step, rows in enumerate((8, 8, 8, 4, 4)):
            loss = model(models.vector_batch(step)[:rows])
            cache.wait_for_stores(60)  # the profiled step (2) measures completed stores
            loss.backward()
            orders.append(_block_order(cache))
            if step == 2:
                assert cache.adaptive_decision is not None, cache.summary()
    assert orders[0] == orders[2] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert orders[-1] == ["blocks.3", "blocks.2", "blocks.1", "blocks.0"], orders


def test_renumbering_moves_the_profile_with_the_blocks() -> None:
    from tba.cache.capture.run_order import RunOrder

    units = [Unit(nn.Linear(1, 1), f"b{i}", i) for i in range(3)]
    order = RunOrder(units)
    profile = StepProfile(3, default_clock(False), lambda: 0.0)
    for unit, nbytes in ((units[2], 30), (units[0], 10)):  # b1 does not run
        order.saw(unit)
        profile.start(unit.block_index)
        profile.add_bytes(unit.block_index, nbytes)
        profile.end(unit.block_index)
    order.saw(units[2])  # again: its first run placed it
    order.finish(profile)
    assert [u.block_index for u in units] == [2, 0, 1]  # b1 (did not run), b2, b0
    assert profile.block_bytes == [0, 30, 10]
    block_s, _ = profile.finish()
    assert block_s[0] == 0.0 and block_s[1] > 0 and block_s[2] > 0
    assert not order.observing
