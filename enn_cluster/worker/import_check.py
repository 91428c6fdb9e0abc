"""`python -m enn_cluster.worker.import_check`: import every worker module, as the image build's
last step. `import enn_cluster.worker` alone loads only a docstring; the modules a task really
needs (and the torch APIs they bind) load lazily, so a dependency missing from the image or an
API the image's torch lacks would otherwise surface on every node of the first job."""
from __future__ import annotations

import importlib
import pkgutil
import sys


def worker_modules() -> list[str]:
    """Every module of enn_cluster.worker except the entry script itself."""
    import enn_cluster.worker as package

    return sorted(m.name for m in pkgutil.iter_modules(package.__path__, package.__name__ + ".")
                  if m.name != package.__name__ + ".__main__")


def main() -> int:
    names = worker_modules()
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # any failure to import is the image's problem
            print(f"import_check: {name} cannot be imported: {type(exc).__name__}: {exc}",
                  file=sys.stderr)
            return 1
    import torch

    print(f"import_check: {len(names)} worker modules import under torch {torch.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
