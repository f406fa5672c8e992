"""Make the GPU suite's virtual environment: one that sees the packages of the Python it is made
from, also when that Python is itself a virtual environment's.

    python benchmarks/_suite_venv.py VENV_DIR

Note [A venv made from a venv]: ``python -m venv --system-site-packages`` gives the new
environment the *base* interpreter's site-packages, not those of the environment ``python``
belongs to. The lent GPU machines keep PyTorch in such an environment (``/opt/torch/.venv``),
so the suite's environment saw no torch and no scikit-build-core, its install failed and every
GPU row skipped. The parent environment's site-packages are therefore listed in a ``.pth`` file
of the new one, after its own: what the suite installs wins, and nothing of the parent's is
copied or changed.
"""

from __future__ import annotations

import site
import subprocess
import sys
import venv
from pathlib import Path

PTH_NAME = "_tba_suite_parent.pth"


def parent_site_packages() -> list[str]:
    """The site-packages of the running environment when it is a virtual environment, else []
    (``--system-site-packages`` already covers a base interpreter's)."""
    if sys.prefix == sys.base_prefix:
        return []
    return [p for p in site.getsitepackages() if Path(p).is_dir()]


def make(venv_dir: Path, *, with_pip: bool = True) -> Path:
    """Create ``venv_dir`` (seeing this Python's packages); returns its python."""
    venv.EnvBuilder(system_site_packages=True, with_pip=with_pip, clear=True).create(venv_dir)
    python = venv_dir / "bin" / "python"
    parents = parent_site_packages()
    if parents:
        purelib = subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True,
        ).stdout.strip()
        (Path(purelib) / PTH_NAME).write_text("".join(f"{p}\n" for p in parents))
    return python


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} VENV_DIR")
    python = make(Path(sys.argv[1]))
    print(f"virtual environment {python.parent.parent} (sees {parent_site_packages() or 'the base interpreter'})")


if __name__ == "__main__":
    main()
