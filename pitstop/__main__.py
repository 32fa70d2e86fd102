"""`python -m pitstop ...` is the `pitstop` command (torchrun launches it this way)."""

import sys

from pitstop.cli import main

sys.exit(main())
