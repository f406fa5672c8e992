"""Tensor subclasses (DTensor) saved for backward: their local tensors are offloaded and the
subclass is rebuilt on unpack, bit-exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import copy, json, os, socket
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
import tba
from tba.testing import probe

s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
dist.init_process_group("gloo", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))

class Block(nn.Module):
    def __init__(self):
        super().__init__(); self.w1 = nn.Linear(16, 64); self.w2 = nn.Linear(64, 16)
    def forward(self, x):
        return x + self.w2(torch.tanh(self.w1(x)))

class Net(nn.Module):
    def __init__(self):
        super().__init__(); self.blocks = nn.ModuleList(Block() for _ in range(3))
    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.pow(2).mean()

torch.manual_seed(0)
ref = Net(); model = copy.deepcopy(ref)
for net in (ref, model):
    for b in net.blocks:
        parallelize_module(b, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
saved_dtensors = []
with tba.configure_tensor_cache(model, offloader="host", offload_devices=("cpu",),
                                min_offload_bytes=0, keep_last_modules=0, adaptive=False) as cache:
    with probe(cache).watch_saves(on_save=lambda s: saved_dtensors.append(s.tensor_type)):
        for step in range(3):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
            a = model(x)
            cache.wait_for_stores(60)  # every store completes: backward reads the locals back
            a.backward()
            b = ref(x); b.backward()
            assert torch.equal(a, b)
    stats = cache.stats(cumulative=True)
grads_equal = all(
    torch.equal(p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad,
                q.grad.full_tensor() if isinstance(q.grad, DTensor) else q.grad)
    for p, q in zip(model.parameters(), ref.parameters()))
print(json.dumps({"grads_equal": grads_equal, "offloaded": stats.offloaded_bytes,
                  "reloaded": stats.reloaded_bytes,
                  "dtensors_saved": saved_dtensors.count("DTensor")}))
dist.destroy_process_group()
"""


def test_dtensor_activations_offloaded_bit_exact(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT)], capture_output=True,
                          text=True, timeout=180, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["grads_equal"]
    assert result["dtensors_saved"] > 0
    assert result["offloaded"] > 0 and result["reloaded"] > 0, result
