"""The budget: expert bytes to read, as ``full``, a fraction, a percentage or a size. Pure."""

from __future__ import annotations
import math
import re
from dataclasses import dataclass
from mergefs.core.errors import BudgetError
from mergefs.core.sizes import parse_size


@dataclass(frozen=True)
class Budget:
    """An expert-read budget: a fraction of all expert bytes, a byte count, or everything."""

    kind: str  # "full" | "fraction" | "bytes"
    value: float = 1.0

    def resolve(self, total_expert_bytes: int) -> int:
        if self.kind == "full":
            return total_expert_bytes
        if self.kind == "fraction":
            return min(total_expert_bytes, math.floor(self.value * total_expert_bytes))
        return min(total_expert_bytes, int(self.value))

    @property
    def is_full(self) -> bool:
        return self.kind == "full" or (self.kind == "fraction" and self.value >= 1.0)

    def to_spec(self) -> str:
        """The budget as a spec value that parses back to exactly this budget."""
        if self.kind == "full":
            return "full"
        if self.kind == "fraction":
            return repr(float(self.value))
        return f"{int(self.value)}B"

    def describe(self) -> str:
        if self.kind == "full":
            return "full"
        if self.kind == "fraction":
            return f"{self.value * 100:g}%"
        return f"{int(self.value)} bytes"


def parse_budget(value: object, what: str = "budget") -> Budget:
    """``full``, a fraction ``0.1`` (``1`` is full), ``10%``, or a size with a unit: ``2GiB``,
    ``1500000B``. A bare number above 1 has no unit and is refused as ambiguous (it was once read
    as bytes, which silently read nothing: ``budget: 10`` meant ten bytes, not 10%).
    ``what`` names the value in errors (``--budget`` on the command line)."""
    err = (
        f"{what}: expected 'full', a fraction in [0, 1] like 0.1, a percentage like 10%, "
        f"or a size like 2GiB; got {value!r}"
    )
    if isinstance(value, bool) or value is None:
        raise BudgetError(err)
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise BudgetError(err)
        if value < 0:
            raise BudgetError(f"{what}: must not be negative, got {value!r}")
        if value > 1:
            raise BudgetError(f"{what}: {value!r} is ambiguous: write {value:g}% for a share of "
                              f"the expert bytes, or {value:g}B / {value:g}MiB for a size")
        return Budget("full") if value == 1 else Budget("fraction", float(value))
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("full", "all", "100%"):
            return Budget("full")
        if text.startswith("-"):
            raise BudgetError(f"{what}: must not be negative, got {value!r}")
        m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*%", text)
        if m:
            pct = float(m.group(1))
            if pct > 100:
                raise BudgetError(f"{what}: {value!r} is more than 100% of the expert bytes")
            return Budget("full") if pct == 100 else Budget("fraction", pct / 100)
        try:
            as_float = float(text)
        except ValueError:
            if re.fullmatch(r"\d+(?:\.\d+)?\s*[a-z]+", text):  # a size: the unit is required
                try:
                    return Budget("bytes", float(parse_size(text, what)))
                except ValueError:
                    pass
            raise BudgetError(err) from None
        if not math.isfinite(as_float):
            raise BudgetError(err)
        if as_float > 1:
            raise BudgetError(f"{what}: {value.strip()} is ambiguous: write {value.strip()}% "
                              f"for a share of the expert bytes, or {value.strip()}B / "
                              f"{value.strip()}MiB for a size")
        return parse_budget(as_float, what)
    raise BudgetError(err)
