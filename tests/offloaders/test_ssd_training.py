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


_KVIKIO_MODELS = (("gpt2", "lm_batch"), ("bert", "lm_batch"), ("t5", "t5_batch"))


@pytest.fixture(scope="module")
def kvikio_runs(tmp_path_factory: pytest.TempPathFactory, fake_libcuda: Path) -> tuple[Path, dict]:
    """Every model of ``_KVIKIO_MODELS`` trained in one child process (kvikio needs the fake
    driver on its library path before it loads): the child's imports of torch, transformers and
    kvikio, about 5 s of CPU on 2 cores, are paid once, not per model. Each model offloads to a
    directory of its own; what its run raised is its result."""
    require_kvikio()
    root = tmp_path_factory.mktemp("kvikio")
    code = f"""
        import json, traceback
        from pathlib import Path
        from tests import models
        from tests.twin import run_twins
        results = {{}}
        for name, batch in {_KVIKIO_MODELS!r}:
            directory = Path({str(root)!r}) / name
            directory.mkdir()
            try:
                cache = run_twins(
                    getattr(models, name), getattr(models, batch), steps=3, settle=True,
                    offloader="ssd", offload_devices=("cpu",), min_offload_bytes=0,
                    ssd_dirs=(str(directory),), ssd_engine="kvikio",
                )
            except BaseException:
                results[name] = {{"failed": traceback.format_exc()}}
                continue
            total = cache.stats(cumulative=True)
            results[name] = {{"engine": cache.offloader.engine, "offloaded": total.offloaded_bytes,
                              "reloaded": total.reloaded_bytes, "errors": total.num_io_errors}}
        print(json.dumps(results))
        """
    result = run_python(code, cwd=root, env=kvikio_env(fake_libcuda, root), timeout_s=300)
    return root, json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("name", [name for name, _ in _KVIKIO_MODELS])
def test_transformers_bit_exact_kvikio(kvikio_runs: tuple[Path, dict], name: str) -> None:
    root, results = kvikio_runs
    total = results[name]
    assert "failed" not in total, total.get("failed")
    assert total["engine"] == "kvikio"
    assert total["offloaded"] > 0 and total["reloaded"] > 0 and total["errors"] == 0
    assert not any(p.name.startswith("tba-ssd-") for p in (root / name).iterdir())
