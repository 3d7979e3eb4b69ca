"""Stop strings over streamed text (OpenAI's `stop`)."""
from __future__ import annotations


class StopMatcher:
    """Cuts generated text at the first stop string, delta by delta.

    A stop string can straddle deltas, so text that could be the start of one is held back
    until it either completes a match or cannot. "First" means the match that completes first
    (as a token stream sees it); among matches ending at the same place, the one that starts
    first. Feeding the whole text at once gives the same result as any split of it.
    """

    def __init__(self, stops: tuple[str, ...] | list[str]) -> None:
        if not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"stop strings must be non-empty strings, got {stops!r}")
        self.stops = tuple(stops)
        self.stopped = False
        self._held = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """The text safe to send now, and whether a stop string was hit (then nothing more
        is ever emitted, and the stop string itself is not)."""
        if self.stopped:
            return "", True
        buf = self._held + delta
        cut = self._first_match(buf)
        if cut is not None:
            self.stopped, self._held = True, ""
            return buf[:cut], True
        keep = self._partial_suffix_len(buf)
        self._held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        """At the end of generation: held-back text was not a stop string after all."""
        out, self._held = self._held, ""
        return out

    def _first_match(self, buf: str) -> int | None:
        """Where to cut: the start of the earliest-ending match in `buf`."""
        best: tuple[int, int] | None = None  # (end, start)
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < best):
                best = (i + len(s), i)
        return None if best is None else best[1]

    def _partial_suffix_len(self, buf: str) -> int:
        """The longest tail of `buf` that is a proper prefix of some stop string."""
        longest = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), longest, -1):
                if buf.endswith(s[:k]):
                    longest = k
                    break
        return longest
