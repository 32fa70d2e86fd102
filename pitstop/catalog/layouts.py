"""Every batching layout pitstop knows, one `Layout` member each, with the facts code checks.

A layout is how an optimizer step's documents are laid out into rows (pitstop.batching.plan):

- `pack`: documents concatenated into rows of exactly max_seq_len (per-document attention
  keeps them apart);
- `bucket`: one document per row, rows of similar length batched together, each
  micro-batch padded to its longest row;
- `pad`: one document per row, every row padded to max_seq_len.

The names are what users write (`--batching pack`, YAML, run records, checkpoints), so
`Layout` is a `str` enum: a member equals its name (`Layout.PACK == "pack"`), prints as it
and serialises to JSON as it. The config's choices, the batching settings' checks, the run
record's validator, tune's search space and the doctor's rules read the facts below instead
of comparing names, so adding a layout means a member here, its rows in the planner
(`batching/plan.py: layout_rows`), and whatever else its properties do not already say
(docs/architecture.md lists the files). `tests/test_layouts.py` keeps the names out of
every other module as string literals.

Sits on the ground floor with the rest of the catalogue, under `pitstop.core` (whose config
and run record read it): imports nothing of pitstop's but `pitstop.errors`.
"""

from __future__ import annotations

from enum import Enum

from pitstop.errors import ConfigError


class Layout(str, Enum):
    """A batching layout; its value is the name users write."""

    PACK = "pack"
    BUCKET = "bucket"
    PAD = "pad"

    # str() and format() give the name, as Python 3.11's StrEnum does (3.10 has no StrEnum,
    # and a plain str-mixin Enum prints "Layout.PACK" in f-strings from 3.12 on).
    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def packed(self) -> bool:
        """Several documents share a row (so attention must be kept per document)."""
        return self is Layout.PACK

    @property
    def fixed_rows(self) -> bool:
        """Every row is max_seq_len wide, so a micro-batch's width never varies."""
        return self in (Layout.PACK, Layout.PAD)

    @property
    def padded_to_max_len(self) -> bool:
        """One document per row, padded to max_seq_len: the most padding of any layout."""
        return self.fixed_rows and not self.packed

    @property
    def step_in_whole_rows(self) -> bool:
        """tokens_per_step must be a multiple of max_seq_len: a step is a number of full rows."""
        return self.packed

    @property
    def dominated_by(self) -> Layout | None:
        """A layout that is never slower than this one on the same data, so `auto` and tune
        need not time this one when that one is a candidate: bucket holds pad's rows padded
        less, with the same kernels."""
        return Layout.BUCKET if self is Layout.PAD else None

    @property
    def description(self) -> str:
        """One line for help text and docs."""
        return _DESCRIPTIONS[self]

    @classmethod
    def parse(cls, text: str | Layout) -> Layout:
        """`text` as a layout; ConfigError naming the valid choices when it is none."""
        found = cls.lookup(text)
        if found is None:
            raise ConfigError(f"batching {text!r} is not one of {choices_text()}")
        return found

    @classmethod
    def lookup(cls, text: object) -> Layout | None:
        """`text` as a layout, None when it names none (e.g. `auto`, a doctor's `dynamic`)."""
        # A dict lookup, not `cls(text)` (about 2.5 us): the planner asks once per step.
        try:
            return _BY_NAME.get(text)  # type: ignore[arg-type]
        except TypeError:  # unhashable (a list from a planted file): no layout
            return None


_DESCRIPTIONS: dict[Layout, str] = {
    Layout.PACK: "documents packed into full rows",
    Layout.BUCKET: "one document per row, batched by length",
    Layout.PAD: "one document per row, padded to the max length",
}

# The names, in the order users see them (help, errors, `auto`'s candidates).
LAYOUT_NAMES: tuple[str, ...] = tuple(m.value for m in Layout)
# Members hash and compare as their names, so one dict answers a name or a member.
_BY_NAME: dict[str, Layout] = {m.value: m for m in Layout}

# A layout that takes any tokens_per_step (no whole-rows rule): for working out a step's
# size before the layout is known (the layout does not change it, only checks it).
ANY_STEP_SIZE: Layout = next(m for m in Layout if not m.step_in_whole_rows)


def worth_timing(step_in_whole_rows_ok: bool) -> tuple[Layout, ...]:
    """The layouts a search should try: none another one dominates, and those needing whole
    rows only when the step is a whole number of rows (`step_in_whole_rows_ok`)."""
    return tuple(
        m
        for m in Layout
        if m.dominated_by is None and (step_in_whole_rows_ok or not m.step_in_whole_rows)
    )


def choices_text() -> str:
    """The valid names, quoted ('pack', 'bucket', 'pad'), for error messages."""
    return ", ".join(repr(n) for n in LAYOUT_NAMES)
