"""Bit-exact training of GPT-2, BERT and T5 (small transformers configs) with tba."""

from __future__ import annotations

import pytest

from tests import models
from tests.twin import run_twins

pytest.importorskip("transformers")

CASES = {
    "gpt2": (models.gpt2, models.lm_batch),
    "bert": (models.bert, models.lm_batch),
    "t5": (models.t5, models.t5_batch),
}


@pytest.mark.parametrize("offloader", ["host", "none"])
@pytest.mark.parametrize("name", list(CASES))
def test_bit_exact_training(name: str, offloader: str) -> None:
    make_model, make_batch = CASES[name]
    cache = run_twins(
        make_model, make_batch, steps=3, settle=True, offloader=offloader,
        offload_devices=("cpu",), min_offload_bytes=0,
    )
    total = cache.stats(cumulative=True)
    assert total.num_steps == 3
    assert total.num_packed > 0
    if offloader == "host":
        assert total.offloaded_bytes > 0
        assert total.reloaded_bytes > 0
        assert total.num_io_errors == 0
    else:
        assert total.offloaded_bytes == 0 and total.reloaded_bytes == 0
        assert total.kept_bytes > 0


def test_t5_blocks_found() -> None:
    import tba

    model = models.t5()
    with tba.configure_tensor_cache(model, offload_devices=("cpu",)) as cache:
        # Encoder and decoder stacks hold the same block type: both are blocks, in order.
        names = [u.name for u in cache.units if u.block_index is not None]
        assert names == ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"]
