"""`python -m ffl_backend.bench`: the same as the `ffl-bench` command."""
import sys

from .cli import main

sys.exit(main())
