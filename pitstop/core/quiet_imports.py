"""Third-party imports that stay quiet: bitsandbytes only when 8-bit or 4-bit is asked for.

Importing `transformers.TrainerCallback` or `TrainingArguments` imports peft (transformers'
trainer utilities check for PEFT models), and peft imports bitsandbytes eagerly
(`peft/helpers.py`: `try: import bitsandbytes`). bitsandbytes >= 0.48 then logs "Failed to
load CPU gemm_4bit_forward from kernels-community ..." on CPUs with AVX512-BF16 when the
`kernels` package is missing: the first line of every `pitstop doctor` and of every script
that imports `pitstop.hf`, which users read as a pitstop failure, about a library their
run does not use.

`without_bitsandbytes()` makes `import bitsandbytes` fail (ModuleNotFoundError, which peft
catches) while the block imports, and only then: a later `import bitsandbytes` (an 8-bit
optimizer, `--load-in-4bit`) loads it as usual. peft's availability checks
(`is_bnb_available`, `importlib.util.find_spec`) are not called during these imports (tests/
test_quiet_start.py checks that 4-bit support is still reported afterwards). When
bitsandbytes is already loaded (the user's script imported it), nothing changes.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

BLOCKED = "bitsandbytes"


class _Blocker(importlib.abc.MetaPathFinder):
    """A finder that answers 'not installed' for bitsandbytes and its submodules."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == BLOCKED or name.startswith(BLOCKED + "."):
            raise ModuleNotFoundError(
                f"{name} is not imported by pitstop unless 8-bit or 4-bit is asked for", name=name
            )
        return None


@contextmanager
def without_bitsandbytes() -> Iterator[None]:
    """Imports inside this block do not load bitsandbytes (see the module docstring)."""
    if BLOCKED in sys.modules:
        yield
        return
    blocker = _Blocker()
    sys.meta_path.insert(0, blocker)
    try:
        yield
    finally:
        sys.meta_path.remove(blocker)
