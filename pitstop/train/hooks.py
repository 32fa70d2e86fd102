"""Explicit extension points of the training loop, for callers that measure it.

`pitstop profile` and `pitstop tune` pass an object with these two methods to
`Trainer(hooks=...)` instead of subclassing the Trainer and overriding its phases.
The loop calls them at fixed points of every optimizer step; the default does nothing
(docs/style.md, 6: a no-op object, not `if hooks:` in the loop).
"""

from __future__ import annotations

from typing import Protocol


class StepHooks(Protocol):
    def step_started(self) -> bool:
        """The step's first micro-batch has just been fetched (inside its data_wait phase).

        True makes the step now starting the last one of the run.
        """
        ...

    def step_ended(self, step: int) -> None:
        """The step's optimizer update has just run (inside its optimizer phase).

        `step` counts the steps done before this one (0 for the first step).
        """
        ...


class NoHooks:
    """The loop's default: nothing happens at step boundaries."""

    def step_started(self) -> bool:
        return False

    def step_ended(self, step: int) -> None:
        pass
