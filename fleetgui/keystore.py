"""The fleet key as the app keeps it: a key file only its owner can read, plus, where the ``keyring``
package and an OS keyring are available, a copy in that keyring.

The engine reads a key file (``engine.fleetkey``), so the file stays the working copy either way:
with a keyring, a key set in the app is stored there too, and a missing default key file is written
back from it (0600) when the app needs it.  Without one the file alone holds the key, and the Fleet
view says so.  Nothing here touches Qt.
"""

from __future__ import annotations

import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

from engine.errors import FleetError
from engine.config import FleetAccess
from engine.fleetkey import create_key, fleet_access, fleet_id, key_file, load_key, load_tls

KEYRING_SERVICE = "fleetshard"
KEYRING_ENTRY = "fleet-key"


def key_path(settings) -> Path:
    """The key file in force for these GUI settings (their path, else the engine's default)."""
    return key_file(settings.fleet_key_file or None)


def _keyring():
    """The keyring module when it is installed and has a usable backend, else None."""
    try:
        # deferred into the try: keyring is an optional package, and without it the file alone holds the key
        import keyring
        from keyring.backends import fail  # (optional too, see above)
    except ImportError:
        return None
    try:
        backend = keyring.get_keyring()
    except Exception:  # a broken keyring configuration: fall back to the file
        return None
    if isinstance(backend, fail.Keyring) or getattr(backend, "priority", 1) <= 0:
        return None
    return keyring


def keyring_name() -> str | None:
    """The OS keyring's name, or None when there is none to use."""
    keyring = _keyring()
    return None if keyring is None else type(keyring.get_keyring()).__name__


@dataclass
class KeyState:
    path: Path
    fleet_id: str | None  # None: no usable key at ``path``
    problem: str | None  # why not, in words
    in_keyring: bool

    @property
    def usable(self) -> bool:
        return self.fleet_id is not None

    def storage(self) -> str:
        """Where the key lives, for the Fleet view."""
        if not self.usable:
            return self.problem or "no fleet key"
        if self.in_keyring:
            return (f"kept in the OS keyring ({keyring_name()}); the engine reads its copy {self.path}, readable "
                    "only by you")
        return f"kept in {self.path}, readable only by you (no OS keyring available to this app)"


def state(settings) -> KeyState:
    path = key_path(settings)
    materialise(path, default=not settings.fleet_key_file)
    try:
        key = load_key(path)
    except (FleetError, OSError) as exc:
        return KeyState(path, None, str(exc) if isinstance(exc, FleetError) else f"cannot read {path}: {exc}", False)
    return KeyState(path, fleet_id(key), None, _in_keyring(key))


def load(settings) -> bytes:
    """The fleet key, or FleetError saying why there is none."""
    path = key_path(settings)
    materialise(path, default=not settings.fleet_key_file)
    return load_key(path)


def tls(settings):
    """The fleet TLS contexts when the settings turn TLS on, else None."""
    return load_tls(settings.tls, key_path(settings))


def access(settings) -> FleetAccess:
    """What the app's deployments and their chains reach the fleet with (``engine.fleetkey.fleet_access``),
    or FleetError saying why there is no key."""
    materialise(key_path(settings), default=not settings.fleet_key_file)
    return fleet_access(settings)


def _in_keyring(key: bytes) -> bool:
    keyring = _keyring()
    if keyring is None:
        return False
    try:
        return keyring.get_password(KEYRING_SERVICE, KEYRING_ENTRY) == key.hex()
    except Exception:
        return False


def remember(key: bytes) -> bool:
    """Stores the key in the OS keyring when there is one; True when it did."""
    keyring = _keyring()
    if keyring is None:
        return False
    try:
        keyring.set_password(KEYRING_SERVICE, KEYRING_ENTRY, key.hex())
    except Exception:  # a locked or refusing keyring: the file still holds the key
        return False
    return True


def materialise(path: Path, default: bool = True) -> bool:
    """Writes the keyring's key to ``path`` (0600) when the default key file is missing; True when it did."""
    if path.exists() or not default:
        return False
    keyring = _keyring()
    if keyring is None:
        return False
    try:
        text = keyring.get_password(KEYRING_SERVICE, KEYRING_ENTRY)
    except Exception:
        return False
    if not text:
        return False
    _write_private(path, text.strip() + "\n")
    return True


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def create(path: Path) -> bytes:
    """A new fleet key at ``path`` (0600), also stored in the keyring when there is one."""
    create_key(path)
    key = load_key(path)
    remember(key)
    return key


def adopt(path: Path) -> tuple[bytes, str | None]:
    """Checks a chosen key file and makes it private to its owner.  Returns the key and a notice
    when its permissions were tightened."""
    key = load_key(path, allow_shared=True)
    notice = None
    if sys.platform != "win32":
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            try:
                os.chmod(path, 0o600)
            except OSError as exc:
                raise FleetError(f"{path} is readable by other users and cannot be made private: "
                                 f"{exc.strerror or exc}") from None
            notice = f"{path} was readable by other users (mode {mode:o}); it is now readable only by you"
    remember(key)
    return key, notice
