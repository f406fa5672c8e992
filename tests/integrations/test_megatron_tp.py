"""tba with Megatron-core's tensor-parallel layers (``VocabParallelEmbedding``,
``ColumnParallelLinear``, ``RowParallelLinear``) on 2 gloo ranks, with and without sequence
parallelism: bit-identical losses and gradients over 3 Adam steps, bytes really offloaded and
reloaded, no parameter storage stored."""

from __future__ import annotations

import importlib.util

import pytest

from tests.integrations import _harness

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        importlib.util.find_spec("megatron") is None
        or importlib.util.find_spec("megatron.core") is None,
        reason="megatron-core is not installed (pip install 'tba[integrations]')",
    ),
]


@pytest.fixture(scope="module")
def results():
    from tests.integrations._megatron_tp_worker import worker

    return _harness.spawn(worker, timeout_s=300, env={"PYTHONWARNINGS": "ignore"})


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp_layers_bit_exact_without_parameter_bytes(results, sequence_parallel):
    _harness.assert_case(results, f"sp={sequence_parallel}/baseline", f"sp={sequence_parallel}/host")
