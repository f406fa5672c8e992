"""Bit-exact training of small GPT-2 (and BERT/T5 through kvikio) with ``offloader="ssd"``.

CPU tensors are offloaded (``offload_devices=("cpu",)``, ``min_offload_bytes=0``) so the whole
path runs without a GPU: pack hook -> store to slab files -> load in backward -> unpack.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import models
from tests.offloaders.ssd_helpers import build_fake_libcuda, kvikio_env, require_kvikio, run_python
from tests.twin import run_twins

pytest.importorskip("transformers")

_OPTIONS = {"offloader": "ssd", "offload_devices": ("cpu",), "min_offload_bytes": 0}


@pytest.fixture(scope="module")
def fake_libcuda(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory holding a freshly built fake ``libcuda.so.1``."""
    return build_fake_libcuda(tmp_path_factory.mktemp("fake_libcuda"))


@pytest.mark.parametrize("num_dirs", [1, 2])
def test_gpt2_bit_exact_posix(tmp_path: Path, num_dirs: int) -> None:
    drives = [tmp_path / f"nvme{i}" for i in range(num_dirs)]
    for d in drives:
        d.mkdir()
    cache = run_twins(
        models.gpt2, models.lm_batch, steps=3, settle=True, ssd_dirs=tuple(map(str, drives)),
        ssd_engine="posix", **_OPTIONS
    )
    total = cache.stats(cumulative=True)
    assert total.offloaded_bytes > 0 and total.reloaded_bytes > 0 and total.num_io_errors == 0
    assert all(list(d.iterdir()) == [] for d in drives)  # the cache closed the offloader


@pytest.mark.parametrize("name, batch", [("gpt2", "lm_batch"), ("bert", "lm_batch"), ("t5", "t5_batch")])
def test_transformers_bit_exact_kvikio(tmp_path: Path, fake_libcuda: Path, name: str, batch: str) -> None:
    require_kvikio()
    code = f"""
        import json
        from tests import models
        from tests.twin import run_twins
        cache = run_twins(
            models.{name}, models.{batch}, steps=3, settle=True, offloader="ssd",
            offload_devices=("cpu",), min_offload_bytes=0, ssd_dirs=({str(tmp_path)!r},),
            ssd_engine="kvikio",
        )
        assert cache.offloader.engine == "kvikio"
        total = cache.stats(cumulative=True)
        print(json.dumps({{"offloaded": total.offloaded_bytes, "reloaded": total.reloaded_bytes,
                          "errors": total.num_io_errors}}))
        """
    result = run_python(code, cwd=tmp_path, env=kvikio_env(fake_libcuda, tmp_path), timeout_s=120)
    total = json.loads(result.stdout.splitlines()[-1])
    assert total["offloaded"] > 0 and total["reloaded"] > 0 and total["errors"] == 0
    assert not any(p.name.startswith("tba-ssd-") for p in tmp_path.iterdir())
