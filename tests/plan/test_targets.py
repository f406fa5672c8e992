"""tba.plan's offload targets: drives (sustained vs burst), the host link, and how the verdict names them."""

from __future__ import annotations

import json

import pytest
import torch

from tba import plan
from tests.conftest import require_cuda

LLAMA = plan.PRESETS["llama3-8b"]


def test_drive_presets_carry_sustained_and_burst():
    for name, drive in plan.DRIVES.items():
        assert 0 < drive.sustained_write_bytes_per_s <= drive.burst_write_bytes_per_s, name
    consumer = plan.DRIVES["samsung-990pro-2tb"]
    assert consumer.write_bytes_per_s("sustained") == 1.5e9 and consumer.write_bytes_per_s("burst") == 6.9e9


def test_plan_uses_sustained_unless_told():
    drive = plan.DRIVES["samsung-990pro-2tb"]
    sustained = plan.plan(LLAMA, 1, step_time_s=10.0, drive=drive, num_drives=4)
    burst = plan.plan(LLAMA, 1, step_time_s=10.0, drive=drive, num_drives=4, drive_write="burst")
    assert sustained.available_write_bytes_per_s == pytest.approx(4 * 1.5e9)
    assert burst.available_write_bytes_per_s == pytest.approx(4 * 6.9e9)
    assert sustained.bandwidth_source == "4 x sustained write of Samsung 990 PRO 2 TB"
    assert "burst" in burst.bandwidth_source
    # 45 GiB in 5 s is 9.7 GB/s: four drives' bursts absorb it, their sustained writes do not.
    assert burst.bandwidth_ok is True and sustained.bandwidth_ok is False


def test_host_offloader_uses_the_host_link():
    link = plan.HOST_LINKS["pcie4"]
    r = plan.plan(LLAMA, 1, step_time_s=1.0, offloader="host", host_link=link,
                  drive=plan.DRIVES["samsung-990pro-2tb"])
    assert r.available_write_bytes_per_s == 25e9 and r.bandwidth_source == "host link PCIe 4.0 x16"
    assert r.lifetime_years is None and r.drive is None  # nothing is written to an SSD
    unknown = plan.plan(LLAMA, 1, step_time_s=1.0, offloader="host")
    assert unknown.available_write_bytes_per_s is None and unknown.bandwidth_ok is None
    # SSD writes cross the host link too: the slower of the two counts.
    capped = plan.plan(LLAMA, 1, step_time_s=1.0, drive=plan.DRIVES["optane-p5800x-1.6tb"], num_drives=8,
                       host_link=plan.HOST_LINKS["pcie3"])
    assert capped.available_write_bytes_per_s == 12.5e9 and "slower than 8 x" in capped.bandwidth_source


def test_plan_lists_every_bad_argument():
    with pytest.raises(ValueError) as e:
        plan.plan(LLAMA, 1, step_time_s=1.0, offloader="disk", drive_write="peak", num_drives=0)
    assert "offloader" in str(e.value) and "drive_write" in str(e.value) and "num_drives" in str(e.value)
    with pytest.raises(ValueError, match="sustained_write_bytes_per_s exceeds"):
        plan.Drive(name="x", capacity_bytes=1, pbw=1, warranty_years=1, burst_write_bytes_per_s=1e9,
                   sustained_write_bytes_per_s=2e9)


def test_cli_names_the_drive_in_the_verdict(capsys):
    assert plan.main(["--model", "llama3-8b", "--brief"]) == 0
    out = capsys.readouterr().out
    verdict = next(line for line in out.splitlines() if line.startswith("Available write bandwidth"))
    assert "[--drive samsung-990pro-2tb (default)]" in verdict and "sustained write" in verdict
    assert "burst 6.90 GB/s" in out
    assert plan.main(["--model", "llama3-70b", "--drive", "optane-p5800x-1.6tb", "--num-ssds", "4", "--brief"]) == 0
    out = capsys.readouterr().out
    assert "[--drive optane-p5800x-1.6tb]" in out and "4 x sustained write of Intel Optane" in out
    assert plan.main(["--model", "qwen2.5-7b", "--drive-write", "burst", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["drive_write"] == "burst" and report["available_write_bytes_per_s"] == 6.9e9
    assert report["target"] == "--drive samsung-990pro-2tb (default)"
    assert report["shape"]["num_kv_heads"] == 4 and report["shape"]["activation"] == "swiglu"


def test_cli_host_offloader(capsys):
    assert plan.main(["--model", "llama3-8b", "--offloader", "host", "--pcie-gen", "5", "--brief"]) == 0
    out = capsys.readouterr().out
    assert "host link PCIe 5.0 x16" in out and "[--pcie-gen 5]" in out and "SSD lifetime" not in out
    assert "pinned per micro-batch" in out
    for bad, message in ((["--offloader", "host"], "needs the host link"),
                         (["--offloader", "host", "--pcie-gen", "4", "--drive", "optane-p5800x-1.6tb"], "writes no SSD"),
                         (["--pcie-gen", "4", "--host-link-gbps", "20"], "give one of")):
        with pytest.raises(SystemExit):
            plan.main(bad)
        assert message in capsys.readouterr().err


def test_cli_llama_overrides(capsys):
    assert plan.main(["--model", "gpt2", "--arch", "llama", "--kv-heads", "4", "--json"]) == 0
    shape = json.loads(capsys.readouterr().out)["shape"]
    assert shape["arch"] == "llama" and shape["num_kv_heads"] == 4 and shape["ffn_size"] == 2048  # 8*768/3
    assert shape["activation"] == "swiglu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_measure_host_link_needs_cuda():
    with pytest.raises(RuntimeError, match="--pcie-gen"):
        plan.measure_host_link()


@pytest.mark.gpu
def test_measure_host_link_on_gpu():
    require_cuda()
    link = plan.measure_host_link(num_bytes=64 * 2**20, repeats=3)
    assert link.bytes_per_s > 1e9 and "measured on" in link.name
