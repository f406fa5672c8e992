"""Fixtures of the malloc hook tests: the hook and fake CUDA libraries built once per session,
and a runner for hook_child.py under LD_PRELOAD. See hook_helpers.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.malloc_hook.hook_helpers import CHILD, HookBuild, build_all, child_env, run_python


@pytest.fixture(scope="session")
def hook_build(tmp_path_factory: pytest.TempPathFactory) -> HookBuild:
    """The hook and the fake libraries, built from source into a session temp directory."""
    return build_all(tmp_path_factory.mktemp("malloc_hook_build"))


@pytest.fixture
def run_ops(hook_build: HookBuild, tmp_path: Path):
    """Runs hook_child.py with a list of operations; returns its JSON report.

    Keyword arguments become environment variables of the child (``None`` removes one).
    """

    def run(ops: list[list], *, app_mode: str = "local", **env_overrides: str | None) -> dict:
        env = child_env(hook_build)
        env["FAKE_APP"] = str(hook_build.fake_app)
        env["FAKE_CUDART"] = str(hook_build.fake_cudart)
        for key, value in env_overrides.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        spec = json.dumps({"ops": ops, "app_mode": app_mode})
        result = run_python([str(CHILD), spec], env=env, cwd=tmp_path)
        if result.returncode != 0:
            pytest.fail(f"hook child failed (rc {result.returncode}):\n{result.stdout}\n{result.stderr}")
        return json.loads(result.stdout.strip().splitlines()[-1])

    return run
