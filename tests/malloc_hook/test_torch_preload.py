"""The hook preloaded into real PyTorch processes: CPU training without CUDA, and (GPU runners)
CUDA training with segments registered."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tba import malloc_hook
from tests.conftest import require_cuda
from tests.malloc_hook.hook_helpers import HookBuild, child_env, run_python

_CPU_TRAINING = """
import json
import torch
import tba
from tba import malloc_hook

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(64, 16)
y = x.sum(dim=1, keepdim=True)
losses = []
for _ in range(30):
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
status = malloc_hook.status()
print(json.dumps({"losses": losses, "status": {
    "preloaded": status.preloaded, "num_allocations": status.num_allocations,
    "cufile_state": status.cufile_state, "last_error": status.last_error}}))
"""

_GPU_TRAINING = """
import json
import torch
from tba import malloc_hook

model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(4)]).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
for _ in range(3):
    optimizer.zero_grad()
    model(torch.randn(2048, 4096, device="cuda")).square().mean().backward()
    optimizer.step()
torch.cuda.synchronize()
during = malloc_hook.status()
reserved_bytes = torch.cuda.memory_reserved()
del model, optimizer
torch.cuda.empty_cache()
after = malloc_hook.status()
print(json.dumps({"during": during.__dict__, "after": after.__dict__, "reserved_bytes": reserved_bytes}))
"""


def _run(code: str, env: dict[str, str], cwd: Path, timeout_s: float = 120) -> dict:
    result = run_python(["-c", code], env=env, cwd=cwd, timeout_s=timeout_s)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_cpu_training_with_hook_preloaded(hook_build: HookBuild, tmp_path: Path) -> None:
    missing_cufile = str(tmp_path / "no_libcufile.so.0")
    preloaded = _run(_CPU_TRAINING, child_env(hook_build, TBA_HOOK_CUFILE_LIBRARY=missing_cufile), tmp_path)
    plain = _run(_CPU_TRAINING, child_env(hook_build, preload=False), tmp_path)

    assert preloaded["status"] == {
        "preloaded": True,
        "num_allocations": 0,
        "cufile_state": "not_loaded",
        "last_error": None,
    }
    assert plain["status"]["preloaded"] is False
    assert preloaded["losses"] == plain["losses"]  # bit-identical training
    assert preloaded["losses"][-1] < 0.5 * preloaded["losses"][0]


@pytest.mark.gpu
def test_cuda_training_registers_segments(hook_build: HookBuild, tmp_path: Path) -> None:
    # The gpu marker alone does not skip here: tests/conftest.py adds its skip fixture at
    # collection-modify time, after fixtures are resolved.
    require_cuda()
    cufile = malloc_hook.cufile_library_path()
    if cufile is None:
        pytest.fail("the GPU test needs cuFile: pip install nvidia-cufile")
    log = str(tmp_path / "cufile.log")
    env = child_env(hook_build, TBA_HOOK_CUFILE_LIBRARY=cufile, CUFILE_LOGFILE_PATH=log)
    report = _run(_GPU_TRAINING, env, tmp_path, timeout_s=300)

    during, after = report["during"], report["after"]
    assert during["preloaded"] and during["allocator_problem"] is None
    assert during["num_allocations"] > 0
    assert during["num_failed"] == 0, during["last_error"]
    assert during["num_registered"] > 0
    assert 0 < during["registered_bytes"] <= report["reserved_bytes"]
    assert after["num_deregistered"] > 0  # empty_cache freed segments, each deregistered first
    assert after["registered_bytes"] < during["registered_bytes"]
