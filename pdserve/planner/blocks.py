"""Block accounting of a simulated worker's decode batch, for any future step in O(1)
(``pdserve.planner.worker``: a running sequence with L tokens holds ceil((L - 1) / bs) blocks
between steps and needs ceil(L / bs) for its next step, as the real block manager counts)."""

from __future__ import annotations


class RunningBlocks:
    """sum_i ceil((n_i + s) / bs) over running sequences, where sequence i holds n_i + s
    tokens' worth of slots at decode step s. Write x_i = n_i + bs - 1 = q_i bs + r_i and
    s = qs bs + rs; then the sum is sum(q_i) + B qs + #{i: r_i >= bs - rs}."""

    def __init__(self, block_size: int):
        self.bs = block_size
        self.q_sum = 0
        self.count = 0
        self.residues = [0] * block_size
        self._above: list[int] | None = None  # _above[j] = sum(residues[j:]); rebuilt after a change

    def add(self, offset: int, sign: int = 1) -> None:
        """A sequence whose slots at step s number ``offset + s`` joins (sign -1: leaves)."""
        q, r = divmod(offset + self.bs - 1, self.bs)
        self.q_sum += sign * q
        self.count += sign
        self.residues[r] += sign
        self._above = None

    def at(self, step: int) -> int:
        qs, rs = divmod(step, self.bs)
        if not rs:
            return self.q_sum + self.count * qs
        above = self._above
        if above is None:  # the batch changed: O(bs) once, then O(1) per call (an epoch's bisection asks ~8)
            above = [0] * (self.bs + 1)
            for j in range(self.bs - 1, -1, -1):
                above[j] = above[j + 1] + self.residues[j]
            self._above = above
        return self.q_sum + self.count * qs + above[self.bs - rs]
