"""The fakes for extenders are public in ``tba.testing``, and tba's own tests use those."""

from __future__ import annotations

import tba.testing
from tba.offloaders import Offloader
from tests.cache import fakes


def test_tests_use_the_public_fakes() -> None:
    assert fakes.FakeOffloader is tba.testing.FakeOffloader
    assert fakes.RecordingStreams is tba.testing.RecordingStreams
    assert isinstance(tba.testing.FakeOffloader(), Offloader)


def test_import_tba_does_not_import_the_testing_package(tmp_path) -> None:
    from tests.offloaders.ssd_helpers import child_env, run_python

    code = """
        import sys, torch
        import tba
        assert "tba.testing" not in sys.modules
        import tba.testing
        # Importing it initialises no CUDA and switches on no stream sanitizer (Note [Stream sanitizer]).
        assert not torch.cuda.is_initialized()
        assert "torch.cuda._sanitizer" not in sys.modules and "transformers" not in sys.modules
        print("ok")
        """
    assert run_python(code, cwd=tmp_path, env=child_env(), timeout_s=120).stdout.split()[-1] == "ok"
