"""The fleet's shared secret and its TLS certificate: where they live, creating and loading them.

Every process that listens or dials proves knowledge of the fleet key (see ``engine.transport.wire``); the key
itself never crosses the wire.  It is a file of 64 hex digits, readable only by its owner, kept in the
user config folder unless the settings or ``--fleet-key-file`` name another.  An admin copies the
same file to every machine of the fleet.

Every fleet connection is also TLS by default (the ``tls`` setting turns it off), mutual, with one
fleet certificate: each side presents it and accepts only a peer presenting it.  The certificate is
derived from the key (an Ed25519 key pair seeded by it, signed the same way on every machine), so a
machine holding the key holds the certificate too and there is nothing more to copy.  A fleet that
wants a certificate of its own makes one with ``fleet key init --tls`` (``fleet.pem`` beside the
key, holding certificate and private key) and copies it to every machine; where that file is, it
takes the derived one's place.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import secrets
import ssl
import tempfile
from pathlib import Path

from engine.config import DEADLINE_S, FleetAccess, Settings, paths
from engine.errors import FleetError

KEY_BYTES = 32


def key_file(override: str | Path | None = None) -> Path:
    """The key file in force: the command-line path, else the settings' path, else the default."""
    if override:
        return Path(override).expanduser()
    configured = Settings.load().fleet_key_file
    return Path(configured).expanduser() if configured else paths().config / "fleet.key"


def create_key(path: Path, force: bool = False) -> Path:
    if path.exists() and not force:
        raise FleetError(f"a fleet key already exists at {path} (pass --force to replace it; every "
                         "machine of the fleet then needs the new key)")
    return _write_secret(path, secrets.token_hex(KEY_BYTES))


def _write_secret(path: Path, text: str) -> Path:
    """Writes ``text`` to a file only its owner can read, replacing it whole (never half written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, path)
    return path


def load_key(override: str | Path | None = None, create: bool = False, *, allow_shared: bool = False) -> bytes:
    """Reads the fleet key; with ``create`` a missing default key is made (a local fleet needs no setup).
    A key file other users can read is refused unless ``allow_shared`` (the app checks a chosen file's key,
    then makes the file private: ``fleetgui.keystore.adopt``)."""
    path = key_file(override)
    if not path.exists():
        if create and not override:
            create_key(path)
        elif path != paths().config / "fleet.key":  # a key file the settings or the command line name
            raise FleetError(f"no fleet key at {path}, the key file the settings or --fleet-key-file name (a "
                             "named key file is never made): copy the fleet's key file there from a PC of the "
                             f"fleet, or make a new fleet's key with `fleet key init --fleet-key-file {path}`")
        else:
            raise FleetError(f"no fleet key at {path}: run `fleet key init` on one machine and copy the "
                             "file to the others, or pass --fleet-key-file PATH")
    text = path.read_text().strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise FleetError(f"fleet key file {path} does not hold hex digits") from None
    if len(key) < 16:
        raise FleetError(f"fleet key in {path} is too short ({len(key)} bytes; at least 16)")
    if not allow_shared:
        _check_private(path, "fleet key")
    return key


def api_key_file() -> Path:
    """The API server's key: the bearer token HTTP clients send (``fleet serve`` off loopback)."""
    return paths().config / "api.key"


def load_api_key(create: bool = False, force: bool = False) -> str:
    """Reads the API key; with ``create`` a missing one is made, with ``force`` a new one replaces it."""
    path = api_key_file()
    if force or (create and not path.exists()):
        _write_secret(path, "fs-" + secrets.token_urlsafe(KEY_BYTES))
    if not path.exists():
        raise FleetError(f"no API key at {path}: run `fleet key api` to create one")
    key = path.read_text().strip()
    if len(key) < 16:
        raise FleetError(f"the API key in {path} is too short ({len(key)} characters; at least 16)")
    _check_private(path, "API key")
    return key


def _check_private(path: Path, what: str) -> None:
    """Refuses a secret other users can read (POSIX; Windows has no mode bits to check)."""
    if os.name != "posix":
        return
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise FleetError(f"other users can read or change the {what} file {path} (mode {mode:03o}): "
                         f"make it private with `chmod 600 {path}`")


def fleet_id(key: bytes) -> str:
    """The fleet's public name: nodes advertise it so peers of one fleet find each other, and it
    reveals nothing of the key (a keyed hash, cut to 12 hex digits)."""
    return hmac.new(key, b"fleetshard fleet id", hashlib.sha256).hexdigest()[:12]


def tls_file(key_path: Path) -> Path:
    """Where a fleet's own certificate lives (``fleet key init --tls``); without it the key gives one."""
    return key_path.with_name("fleet.pem")


def create_certificate(path: Path, force: bool = False) -> Path:
    """A self-signed fleet certificate and its private key in one PEM file."""
    # Deferred: only creating a certificate needs cryptography (~70 ms to import), not every process
    # that reads the fleet key; a missing package is refused below.
    try:
        from cryptography import x509  # deferred, see above
        from cryptography.hazmat.primitives import hashes, serialization  # deferred, see above
        from cryptography.hazmat.primitives.asymmetric import ec  # deferred, see above
        from cryptography.x509.oid import NameOID  # deferred, see above
    except ImportError:
        raise FleetError("creating a TLS certificate needs the 'cryptography' package") from None
    if path.exists() and not force:
        raise FleetError(f"a fleet certificate already exists at {path} (pass --force to replace it)")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fleetshard fleet")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    pem = cert.public_bytes(serialization.Encoding.PEM) + key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    return path


class TLS:
    """Server and client contexts that accept exactly the fleet certificate, and present it: each
    side of a connection checks the other's.  ``pem``: a file holding the certificate and its
    private key (``load_tls`` finds or derives it)."""

    def __init__(self, pem: Path):
        if not pem.exists():
            raise FleetError(f"no fleet certificate at {pem}: copy the fleet's fleet.pem there")
        try:
            self.server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            self.server.minimum_version = ssl.TLSVersion.TLSv1_2
            self.server.load_cert_chain(pem)
            self.server.verify_mode = ssl.CERT_REQUIRED  # mutual: the client presents the fleet certificate too
            self.server.load_verify_locations(pem)
            self.client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            self.client.minimum_version = ssl.TLSVersion.TLSv1_2
            self.client.check_hostname = False  # the pinned fleet certificate is the identity, not a host name
            self.client.load_verify_locations(pem)
            self.client.load_cert_chain(pem)
        except (ssl.SSLError, OSError) as exc:
            raise FleetError(f"cannot use the fleet certificate {pem}: {exc}") from None

    @classmethod
    def of_key(cls, key: bytes) -> "TLS":
        """The contexts of the certificate the fleet key gives (``key_certificate``)."""
        with tempfile.TemporaryDirectory() as folder:  # ssl reads a private key from a file only
            return cls(_write_secret(Path(folder) / "fleet.pem", key_certificate(key).decode().strip()))


def key_certificate(key: bytes) -> bytes:
    """The fleet certificate the key gives, in PEM with its private key: an Ed25519 key pair seeded
    by a keyed hash of the fleet key, self-signed (Ed25519 signs deterministically, and the serial
    and dates are fixed), so every machine holding the key makes the same bytes."""
    from cryptography import x509  # deferred: a process that speaks no TLS does without it (~70 ms to import)
    from cryptography.hazmat.primitives import serialization  # deferred, see above
    from cryptography.hazmat.primitives.asymmetric import ed25519  # deferred, see above
    from cryptography.x509.oid import NameOID  # deferred, see above

    def derived(label: bytes) -> bytes:
        return hmac.new(key, b"fleetshard tls " + label, hashlib.sha256).digest()

    private = ed25519.Ed25519PrivateKey.from_private_bytes(derived(b"certificate key"))
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"fleetshard fleet {fleet_id(key)}")])
    utc = datetime.timezone.utc
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(private.public_key())
            .serial_number(int.from_bytes(derived(b"serial")[:16], "big") >> 1 or 1)
            .not_valid_before(datetime.datetime(2000, 1, 1, tzinfo=utc))
            .not_valid_after(datetime.datetime(9999, 12, 31, tzinfo=utc))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(private, None))
    return cert.public_bytes(serialization.Encoding.PEM) + private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def load_tls(enabled: bool, key_override: str | Path | None = None) -> TLS | None:
    """The fleet's TLS contexts when ``enabled`` (the settings' ``tls``), else None: the certificate
    in ``fleet.pem`` beside the key when the fleet made one, else the one the key gives."""
    if not enabled:
        return None
    path = key_file(key_override)
    pem = tls_file(path)
    return TLS(pem) if pem.exists() else TLS.of_key(load_key(path))


def fleet_access(settings: Settings, create: bool = False) -> FleetAccess:
    """The fleet access the settings give (their key file, TLS and deadline): the key and the TLS
    contexts loaded once, for every connection of a chain, a worker, a deployment or a failover.
    ``create``: a missing default key is made (a local fleet needs no setup); a key file the
    settings name is never made."""
    return access_of(settings.fleet_key_file, tls=settings.tls, deadline_s=settings.deadline_s,
                     create=create and not settings.fleet_key_file)


def access_of(override: str | Path | None = None, *, tls: bool = False, deadline_s: float = DEADLINE_S,
              create: bool = False) -> FleetAccess:
    """The fleet access of the key file in force (``key_file``: ``override``, else the settings'), with
    its TLS contexts when ``tls`` and the ``deadline_s`` given; it keeps the file's path for the
    processes started for the fleet.  ``create``: as ``load_key``'s."""
    path = key_file(override)
    key = load_key(override, create=create)
    return FleetAccess(key, load_tls(tls, override), deadline_s, key_file=path)
