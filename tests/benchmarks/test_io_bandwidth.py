"""Smoke test of benchmarks/io_bandwidth.py: a few MiB, a couple of runs, sane JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.offloaders.ssd_helpers import REPO_ROOT, run_python


def test_io_bandwidth_smoke(tmp_path: Path) -> None:
    out = tmp_path / "bw.json"
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    code = (
        "import runpy, sys\n"
        f"sys.argv = [{str(REPO_ROOT / 'benchmarks' / 'io_bandwidth.py')!r}, '--dir', {str(data_dir)!r}, "
        f"'--size-mib', '4', '--runs', '2', '--engines', 'posix', '--chunk-mib', '1', '--out', {str(out)!r}]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    result = run_python(code, cwd=tmp_path, timeout_s=120)
    assert "# io_bandwidth environment" in result.stdout and "raw_odirect" in result.stdout
    assert "verify GB/s" in result.stdout and "verify='checksum' adds" in result.stdout
    report = json.loads(out.read_text())
    assert report["num_bytes"] == 4 << 20 and report["runs"] == 2
    env = report["environment"]
    assert env["torch"] and env["python"] == ".".join(map(str, sys.version_info[:3]))
    assert env["filesystem"]["fstype"] != "?" and "--size-mib" in env["command"]
    for method in ("raw_odirect", "posix", "posix+checksum"):
        result_ = report["results"][method]
        for key in ("write_bytes_per_s", "read_bytes_per_s"):
            assert 1e6 < result_[key] < 1e12, (method, key, result_[key])
        assert len(result_["write_samples"]) == 2 and result_["write_vs_raw"] > 0
    assert 1e6 < report["results"]["checksum"]["verify_bytes_per_s"] < 1e13
    assert isinstance(report["results"]["posix+checksum"]["verify_overhead"], float)
    assert len(env["loadavg_1_5_15min"]) == 3
    assert list(data_dir.iterdir()) == []  # benchmark files cleaned up
