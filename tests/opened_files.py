"""`opened(monkeypatch, suffix)`: the names of the files with that suffix that code opens
through `Path.open` from now on (the test's monkeypatch undoes it): did it read them?"""
from __future__ import annotations

from pathlib import Path


def opened(monkeypatch, suffix: str) -> list[str]:
    names: list[str] = []
    real = Path.open

    def counting(self, *args, **kwargs):
        if self.suffix == suffix:
            names.append(self.name)
        return real(self, *args, **kwargs)
    monkeypatch.setattr(Path, "open", counting)
    return names
