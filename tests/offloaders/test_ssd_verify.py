"""Verified reloads: bytes changed on disk behind the offloader's back raise ``OffloadIOError``
on the posix and kvikio (compat) engines, in the offloader and in training with both
``on_io_error`` modes; ``verify="none"`` hands back what is on disk; a load through an extent
that was freed and given to another tensor is caught either way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tba
from tba.errors import OffloadIOError
from tba.offloaders.ssd import SSDOffloader
from tba.offloaders.ssd._checksum import digest_of
from tests import models
from tests.offloaders.ssd_helpers import (
    TAMPER_KINDS,
    build_fake_libcuda,
    kvikio_env,
    require_kvikio,
    run_python,
    tamper,
    tamper_every_extent,
    typed_tensor,
)

_SIZE = 300_001  # several 64 KiB chunks and an odd tail


@pytest.fixture(scope="module")
def fake_libcuda(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_fake_libcuda(tmp_path_factory.mktemp("fake_libcuda"))


# Shared by the in-process posix test and the kvikio child: store two tensors, tamper with the
# first, load it; report what happened.
_TAMPER_CASE = """
def tamper_case(off, kind):
    import torch
    from tba.errors import OffloadIOError
    from tests.offloaders.ssd_helpers import tamper, typed_tensor
    src, other = typed_tensor({size}, torch.uint8, seed=1), typed_tensor({size}, torch.uint8, seed=2)
    token, token2 = off.store(src), off.store(other)
    tamper(kind, token, token2)
    out = torch.empty_like(src)
    try:
        off.load(token, out)
    except OffloadIOError as e:
        extent = token.extents[0]
        result = {{"raised": str(e), "path_ok": e.path == extent.slab.path,
                  "offset_ok": e.offset == extent.data_offset, "bytes": e.num_bytes}}
    else:
        result = {{"raised": None, "equal": bool(torch.equal(out, src))}}
    off.release(token)
    off.release(token2)
    return result
""".format(size=_SIZE)


def _check(result: dict, verify: str, where: str) -> None:
    if verify == "checksum":
        assert result["raised"] is not None, f"{where}: tampering not detected"
        assert "the data on disk changed since it was written" in result["raised"], where
        assert result["path_ok"] and result["offset_ok"] and result["bytes"] == _SIZE, (where, result)
    else:
        # Documented behaviour of verify="none": the bytes on disk come back as they are.
        assert result["raised"] is None and result["equal"] is False, (where, result)


@pytest.mark.parametrize("verify", ["checksum", "none"])
@pytest.mark.parametrize("kind", TAMPER_KINDS)
def test_tampering_posix(tmp_path: Path, kind: str, verify: str) -> None:
    namespace: dict = {}
    exec(_TAMPER_CASE, namespace)  # noqa: S102 - the same case text the kvikio child runs
    off = SSDOffloader(dirs=(tmp_path,), engine="posix", slab_bytes=1 << 20, chunk_bytes=64 << 10, verify=verify)
    try:
        _check(namespace["tamper_case"](off, kind), verify, f"posix {kind}")
        # Still usable afterwards: an untouched tensor round-trips.
        src = typed_tensor(_SIZE, torch.uint8, seed=3)
        token = off.store(src)
        out = torch.empty_like(src)
        off.load(token, out)
        assert torch.equal(out, src)
    finally:
        off.close()


def test_tampering_kvikio(tmp_path: Path, fake_libcuda: Path) -> None:
    require_kvikio()
    code = _TAMPER_CASE + f"""
import json
from tba.offloaders.ssd import SSDOffloader
results = {{}}
for verify in ("checksum", "none"):
    off = SSDOffloader(dirs=[{str(tmp_path)!r}], engine="kvikio", slab_bytes=1 << 20, verify=verify)
    assert off.engine == "kvikio"
    for kind in {TAMPER_KINDS!r}:
        results[verify + ":" + kind] = tamper_case(off, kind)
    off.close()
print(json.dumps(results))
"""
    result = run_python(code, cwd=tmp_path, env=kvikio_env(fake_libcuda, tmp_path), timeout_s=120)
    results = json.loads(result.stdout.splitlines()[-1])
    for verify in ("checksum", "none"):
        for kind in TAMPER_KINDS:
            _check(results[f"{verify}:{kind}"], verify, f"kvikio {verify} {kind}")
    assert not any(p.name.startswith("tba-ssd-") for p in tmp_path.iterdir())


# --- in training --------------------------------------------------------------------------------

_TRAIN_CASE = """
def train_tampered(directory, engine, mode):
    import torch, tba
    from tests import models
    from tests.offloaders.ssd_helpers import tamper_every_extent
    torch.manual_seed(0)
    model = models.Stack(num_blocks=4, width=256)
    cache = tba.configure_tensor_cache(
        model, offloader="ssd", ssd_engine=engine, ssd_dirs=(directory,), offload_devices=("cpu",),
        min_offload_bytes=0, adaptive=False, keep_last_modules=0, prefetch_modules=0, on_io_error=mode)
    try:
        loss = model(torch.randn(64, 16))
        cache.wait_for_stores(timeout_s=60)
        changed = tamper_every_extent(cache.offloader)
        try:
            loss.backward()
        except tba.OffloadIOError as e:
            return {"changed": changed, "raised": str(e)}
        return {"changed": changed, "raised": None}
    finally:
        cache.close()
"""


def _check_training(result: dict, where: str) -> None:
    assert result["changed"] > 0, f"{where}: nothing was offloaded, the test proves nothing"
    assert result["raised"] is not None and "changed since it was written" in result["raised"], (where, result)


@pytest.mark.parametrize("mode", ["raise", "keep"])
def test_tampering_in_training_posix(tmp_path: Path, mode: str) -> None:
    namespace: dict = {}
    exec(_TRAIN_CASE, namespace)  # noqa: S102 - the same case text the kvikio child runs
    _check_training(namespace["train_tampered"](str(tmp_path), "posix", mode), f"posix {mode}")
    assert list(tmp_path.iterdir()) == []


def test_tampering_in_training_kvikio(tmp_path: Path, fake_libcuda: Path) -> None:
    require_kvikio()
    code = _TRAIN_CASE + f"""
import json
print(json.dumps({{mode: train_tampered({str(tmp_path)!r}, "kvikio", mode) for mode in ("raise", "keep")}}))
"""
    result = run_python(code, cwd=tmp_path, env=kvikio_env(fake_libcuda, tmp_path), timeout_s=180)
    results = json.loads(result.stdout.splitlines()[-1])
    for mode in ("raise", "keep"):
        _check_training(results[mode], f"kvikio {mode}")


def test_untampered_training_is_bit_exact_with_verification_on(tmp_path: Path) -> None:
    from tests.twin import run_twins

    cache = run_twins(
        lambda: models.Stack(num_blocks=4, width=128), models.vector_batch, steps=3, settle=True, offloader="ssd",
        ssd_engine="posix", ssd_dirs=(str(tmp_path),), offload_devices=("cpu",), min_offload_bytes=0,
        adaptive=False, keep_last_modules=0, prefetch_modules=0, verify="checksum",
    )
    assert cache.offloader.verify == "checksum"
    total = cache.stats(cumulative=True)
    assert total.offloaded_bytes > 0 and total.reloaded_bytes > 0 and total.num_io_errors == 0


# --- reuse of a freed extent -----------------------------------------------------------------


@pytest.mark.parametrize("verify", ["checksum", "none"])
def test_load_of_a_freed_and_reused_extent_raises(tmp_path: Path, verify: str) -> None:
    off = SSDOffloader(dirs=(tmp_path,), engine="posix", slab_bytes=1 << 20, verify=verify)
    try:
        # One source for both stores: the same page offset in memory, so the same pages on disk
        # (Note [Direct windows]).
        ones = torch.ones(8192, dtype=torch.uint8)
        first = off.store(ones)
        extent = first.extents[0]
        # A bug elsewhere frees the extent behind the token's back; the next store reuses it,
        # with the very same bytes, so no checksum could tell.
        extent.slab_dir.free(extent.slab, extent.file_offset, extent.serial)
        second = off.store(ones)
        assert second.extents[0].file_offset == extent.file_offset
        with pytest.raises(OffloadIOError, match="freed and given to another tensor") as info:
            off.load(first, torch.empty(8192, dtype=torch.uint8))
        assert info.value.path == extent.slab.path and info.value.offset == extent.data_offset
        off.release(first)  # must not free the second tensor's extent
        third = off.store(torch.zeros(8192, dtype=torch.uint8))
        assert third.extents[0].file_offset != extent.file_offset
        out = torch.empty(8192, dtype=torch.uint8)
        off.load(second, out)
        assert torch.equal(out, torch.ones(8192, dtype=torch.uint8))
    finally:
        off.close()


# --- the checksums the engines compute while transferring ------------------------------------


@pytest.mark.parametrize("engine_chunk", [4096, 64 << 10, 8 << 20])
def test_digests_taken_during_io_equal_the_whole_range_digest(tmp_path: Path, engine_chunk: int) -> None:
    drives = [tmp_path / "a", tmp_path / "b"]
    for d in drives:
        d.mkdir()
    off = SSDOffloader(dirs=drives, engine="posix", slab_bytes=4 << 20, chunk_bytes=engine_chunk,
                       stripe_min_bytes=4096)
    try:
        for size in (1, 511, 4097, 3 * (1 << 20) + 1):
            src = typed_tensor(size, torch.uint8, seed=size)
            token = off.store(src)
            assert token.digests is not None and len(token.digests) == len(token.extents)
            for extent, digest in zip(token.extents, token.digests):
                assert digest == digest_of(src[extent.start : extent.stop]), (size, extent.start)
            out = torch.empty(size + 3, dtype=torch.uint8)[3:]  # unaligned destination
            off.load(token, out)
            assert torch.equal(out, src)
    finally:
        off.close()


def test_config_verify_reaches_the_offloader(tmp_path: Path) -> None:
    model = models.Stack(num_blocks=2)
    with tba.configure_tensor_cache(model, offloader="ssd", ssd_dirs=(tmp_path,), ssd_engine="posix",
                                    offload_devices=("cpu",), verify="none") as cache:
        assert cache.offloader.verify == "none"
    with pytest.raises(ValueError, match=r"verify='sha1': expected one of \('checksum', 'none'\)"):
        tba.configure_tensor_cache(models.Stack(num_blocks=2), offloader="ssd", verify="sha1")
