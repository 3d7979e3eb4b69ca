"""Where a generated admin key is kept: a file only its user can read, never a log.

A deployment started without an admin key gets a random one (`ServeSettings`). Logs are
read by more people than the operator (Ray's log files, a log shipper, a shared terminal),
so the key goes to `$XDG_STATE_HOME/kvtier/admin-key` (`~/.local/state/kvtier/admin-key`
by default), mode 0600 in a directory of mode 0700 that the user owns, and only that path
is printed or logged. A key the user gave is theirs: it is written nowhere.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from kvtier.errors import ConfigError

FILE_NAME = "admin-key"


def admin_key_dir() -> Path:
    """`$XDG_STATE_HOME/kvtier`, or `~/.local/state/kvtier` (the XDG default)."""
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"),
                                                             ".local", "state")
    return Path(state) / "kvtier"


def save_admin_key(key: str, directory: Path | None = None) -> Path:
    """Write `key` to `directory`/admin-key (default `admin_key_dir()`), readable by this
    user only; its path. The file is replaced whole, so a reader never sees half a key.
    Raises ConfigError when the directory cannot be made private to this user."""
    folder = Path(directory) if directory is not None else admin_key_dir()
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        _make_private(folder)
        path = folder / FILE_NAME
        tmp = folder / f".{FILE_NAME}.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask, and a stale file's mode
            os.write(fd, key.encode() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        raise ConfigError(f"the generated admin key cannot be written to {folder}: "
                          f"{exc.strerror or exc}; choose a key with --admin-key (admin_key), "
                          f"or set XDG_STATE_HOME to a directory of yours") from None
    return path


def _make_private(folder: Path) -> None:
    """`folder` is a real directory of this user's, closed to everyone else (0700)."""
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{folder} is not a directory (a link?); remove it, or set "
                          f"XDG_STATE_HOME to a directory of yours")
    if st.st_uid != os.getuid():
        raise ConfigError(f"{folder} belongs to user id {st.st_uid}, not to you "
                          f"({os.getuid()}): the admin key would not be private there; set "
                          f"XDG_STATE_HOME to a directory of yours, or choose a key with "
                          f"--admin-key")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(folder, 0o700)
