"""Where ffl_backend keeps what it builds or converts once per machine: converted model weights,
compiled C++ kernels, exported GGUF files. `$FFL_CACHE_DIR`, else ~/.cache/ffl_backend."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The cache root, read from the environment at each call (tests and users may set it late)."""
    return Path(os.environ.get("FFL_CACHE_DIR", Path.home() / ".cache" / "ffl_backend"))
