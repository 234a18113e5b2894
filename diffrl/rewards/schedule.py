"""Reward weights that change over a run: `--reward-schedule NAME:START:END:FIRST:LAST`.

The weight of the `multi:` term NAME moves linearly from START at rollout FIRST to END at rollout LAST, and stays at
START before and END after; terms without a schedule keep their `multi:` weight. Rewards that pull apart (a
preference model and an OCR hit, say) are often weighed this way: the easy term first, the hard one brought in
later. The terms are scored once, unweighted (`TermScores`); the trainer sums them with the rollout's weights
before its advantages, wherever they were scored (in-process, worker processes, a reward server's components).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WeightRamp:
    term: str
    start: float
    end: float
    first: int
    last: int

    def at(self, rollout: int) -> float:
        if rollout <= self.first:
            return self.start
        if rollout >= self.last:
            return self.end
        return self.start + (self.end - self.start) * (rollout - self.first) / (self.last - self.first)


def parse_schedule(entries, terms: dict[str, float]) -> list[WeightRamp]:
    """`NAME:START:END:FIRST:LAST` entries for the terms of a `multi:` reward (`terms`: name → weight), or a
    ValueError naming the entry."""
    ramps: dict[str, WeightRamp] = {}
    for entry in entries:
        parts = entry.rsplit(":", 4)  # a term's name may itself hold a colon (module:function)
        if len(parts) != 5:
            raise ValueError(f"--reward-schedule {entry}: expected NAME:START:END:FIRST:LAST (e.g. ocr:0:1:0:100)")
        name, numbers = parts[0], parts[1:]
        if name not in terms:
            raise ValueError(f"--reward-schedule {entry}: {name!r} is not a term of the multi: reward (terms: "
                             f"{', '.join(terms) or 'none: --reward is not a multi: sum'})")
        if name in ramps:
            raise ValueError(f"--reward-schedule: {name!r} is scheduled twice")
        try:
            start, end, first, last = float(numbers[0]), float(numbers[1]), int(numbers[2]), int(numbers[3])
        except ValueError:
            raise ValueError(f"--reward-schedule {entry}: START and END are numbers, FIRST and LAST rollout "
                             "indices") from None
        if not 0 <= first < last:
            raise ValueError(f"--reward-schedule {entry}: needs 0 <= FIRST < LAST")
        ramps[name] = WeightRamp(name, start, end, first, last)
    return list(ramps.values())


def weights_at(terms: dict[str, float], ramps: list[WeightRamp], rollout: int) -> dict[str, float]:
    """Every term's weight at `rollout`: its ramp's where it has one, else its `multi:` weight."""
    scheduled = {r.term: r.at(rollout) for r in ramps}
    return {name: scheduled.get(name, weight) for name, weight in terms.items()}
