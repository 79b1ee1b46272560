"""The daemon's own hotness counts, for `moectl pin --from-stats`.

`Heat` keeps decayed access counts per expert so an operator can pin what the
engines actually use: every access adds 1 and all counts halve every
`half_life` accesses (amortised O(1) per access); a count that decays below a
quarter is forgotten, so the table holds only what is still being used.
"""

from __future__ import annotations


class Heat:
    """Decayed access counts per ExpertKey."""

    def __init__(self, half_life: int = 1 << 16):
        self.half_life = half_life
        self.counts: dict = {}
        self._since = 0

    def add(self, slots) -> None:
        counts = self.counts
        for s in slots:
            key = s.key
            counts[key] = counts.get(key, 0.0) + 1.0
        self._since += len(slots)
        if self._since >= self.half_life:
            self._decay()

    def _decay(self) -> None:
        self._since = 0
        self.counts = {k: v / 2 for k, v in self.counts.items() if v >= 0.25}

    def ranked(self, model_id: int) -> list[tuple[int, int]]:
        """(layer, expert) of one model, hottest first."""
        mine = [(v, k) for k, v in self.counts.items() if k.model_id == model_id]
        mine.sort(key=lambda vk: -vk[0])
        return [(k.layer, k.expert) for _, k in mine]
