"""What a node is: its stable id, the facts it tells the fleet (OS, CPU, memory, OpenVINO devices),
and the compact mDNS TXT and JSON forms of those facts.  Its memory and cores are what the agent's
process may use (``engine.limits``): a PC simulated by a memory-capped cgroup and a CPU set
reports the PC, not the host.

Each node agent is its own node: the machine's id (``node_id``) for an agent of the default name,
and for a named one an id derived from the machine's and the name (``agent_node_id``), so several
agents on one PC (a demo fleet, network namespaces sharing the config folder) are several nodes,
each under the same id at every start.  A demo node reports a ``SimulatedDevice`` instead of its
real ones, marked as simulated wherever it is shown.

A TXT record arrives from anyone on the LAN, so decoding is strict and bounded: a record that is
malformed or too large raises ``BadRecord`` naming the reason, and the browser skips that node.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import json
import logging
import os
import platform
import re
import secrets
import socket

from engine.config import paths
from engine.errors import FleetError
from engine.limits import process_cores, process_memory
from engine.hostcpu import NONE, cpu_model, int8_dot
from engine.kernels import GGML, STOCK
from engine.transport.wire import VERSION

log = logging.getLogger(__name__)

MAX_ENTRY = 255  # one TXT string, "key=value", is at most 255 bytes (RFC 6763 §6.1)
MAX_RECORD = 1400  # a whole TXT record; ours is a few hundred bytes, at most about 1250
MAX_ENTRIES = 40
MAX_DEVICES = 8
# Strings are clipped to these many UTF-8 bytes when encoded, so every entry stays within MAX_ENTRY.
CLIP = {"name": 63, "os": 63, "cpu": 127, "ov": 31, "st": 31, "full_name": 63, "i8": 15, "kp": 8}
# which kernels multiply a node's matrices on its CPU (``engine.kernels.path``), in words
KERNEL_PATHS = {GGML: "our CPU kernels", STOCK: "OpenVINO's own"}

_NODE_ID = re.compile(r"[0-9a-f]{8,32}")
_FLEET_ID = re.compile(r"[0-9a-f]{12}")
_DEVICE = re.compile(r"[A-Z][A-Z0-9_.]{0,31}")
_INT = re.compile(r"[0-9]{1,12}")
_INT8_DOT = re.compile(r"[A-Za-z0-9 -]{0,15}")  # "AVX-512 VNNI", "none"; a newer node may name others
_KERNEL_PATH = re.compile(r"[a-z]{0,8}")  # KERNEL_PATHS' keys; a newer node may name others


class BadRecord(FleetError):
    """A node's advertised facts are malformed or oversized; the reason says which part."""


def node_id() -> str:
    """This machine's id: random, made on first use and kept in the config folder."""
    path = paths().config / "node.id"
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        text = ""
    if _NODE_ID.fullmatch(text):
        return text
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"node.id.{os.getpid()}.tmp")
    tmp.write_text(secrets.token_hex(8) + "\n")
    os.replace(tmp, path)
    return path.read_text().strip()


def agent_node_id(name: str | None) -> str:
    """The id of a node agent on this machine: the machine's own for the default name (None), else
    one derived from it and ``name``, stable across restarts and distinct per name."""
    if name is None:
        return node_id()
    return hashlib.sha256(f"{node_id()}/{name}".encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class SimulatedDevice:
    """A device a demo node pretends to have: reported as ``name`` (``full_name``) with ``memory_mb``,
    its measured costs divided by ``speed`` in profiles, while its shards run on ``runs_on`` here."""

    name: str  # an OpenVINO-style device name, "GPU"
    full_name: str
    memory_mb: int
    speed: float = 1.0
    runs_on: str = "CPU"

    def __post_init__(self):
        if not _DEVICE.fullmatch(str(self.name)) or not _DEVICE.fullmatch(str(self.runs_on)):
            raise FleetError(f"simulated device: {self.name!r} / runs_on {self.runs_on!r} is not a device name "
                             "like GPU or CPU")
        if not isinstance(self.memory_mb, int) or not 0 < self.memory_mb < 1 << 30:
            raise FleetError(f"simulated device {self.name}: memory_mb must be a positive whole number of MB, "
                             f"not {self.memory_mb!r}")
        if not isinstance(self.speed, (int, float)) or not 0.01 <= self.speed <= 100:
            raise FleetError(f"simulated device {self.name}: speed must be a number from 0.01 to 100, "
                             f"not {self.speed!r}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "SimulatedDevice":
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise FleetError(f"simulated device: not JSON ({exc})") from None
        known = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(data, dict) or not {"name", "full_name", "memory_mb"} <= set(data) or set(data) - known:
            raise FleetError(f"simulated device: give a JSON object with name, full_name, memory_mb and "
                             f"optionally speed, runs_on, not {text[:80]!r}")
        return cls(**data)

    def device(self) -> dict:
        """The device entry a node reports for it."""
        return {"name": self.name, "full_name": _clip(f"simulated {self.full_name}", CLIP["full_name"]),
                "memory_mb": self.memory_mb}


@dataclasses.dataclass
class NodeInfo:
    node_id: str
    name: str  # display name
    os: str  # "Linux 6.1", "Windows 11"
    cpu: str  # model string
    cores: int  # logical
    memory_mb: int  # total
    available_mb: int
    openvino: str  # version, "" when OpenVINO is missing
    devices: list[dict]  # {"name": "GPU.0", "full_name": ..., "memory_mb": int | None}
    port: int  # the agent's control port
    fleet_id: str
    addresses: list[str] = dataclasses.field(default_factory=list)  # filled by discovery
    version: int = VERSION
    status: str = "ready"  # the agent's current activity, for display (clipped to 31 bytes on the wire)
    simulated: bool = False  # a demo node: its devices are simulated (``SimulatedDevice``)
    int8_dot: str = ""  # the CPU's int8 dot-product instructions (``engine.hostcpu.int8_dot``); "": unknown
    kernels: str = ""  # which kernels run its CPU stages' matrices (a key of KERNEL_PATHS); "": unknown

    def to_txt(self) -> dict[str, str]:
        listed: list[str] = []
        for d in self.devices[:MAX_DEVICES]:
            part = d["name"] if d.get("memory_mb") is None else f"{d['name']}:{d['memory_mb']}"
            if len(",".join(listed + [part])) > MAX_ENTRY - len("dev="):
                break
            listed.append(part)
        txt = {"v": str(self.version), "id": self.node_id, "fleet": self.fleet_id,
               "name": _clip(self.name, CLIP["name"]), "os": _clip(self.os, CLIP["os"]),
               "cpu": _clip(self.cpu, CLIP["cpu"]), "cores": str(self.cores), "mem": str(self.memory_mb),
               "avail": str(self.available_mb), "ov": _clip(self.openvino, CLIP["ov"]),
               "st": _clip(self.status, CLIP["st"]), "dev": ",".join(listed)}
        if self.simulated:
            txt["sim"] = "1"
        if self.int8_dot:
            txt["i8"] = _clip(self.int8_dot, CLIP["i8"])
        if self.kernels:
            txt["kp"] = _clip(self.kernels, CLIP["kp"])
        for i, d in enumerate(self.devices[:len(listed)]):
            if d.get("full_name"):
                txt[f"d{i}"] = _clip(d["full_name"], CLIP["full_name"])
        return txt

    @classmethod
    def from_txt(cls, name: str, txt: dict[bytes, bytes | None], addresses: list[str], port: int) -> "NodeInfo":
        """Decodes a peer's record; ``name`` is its service instance name (named in reasons, and the
        display name when the record has none)."""
        label = name.split("._", 1)[0]
        if len(txt) > MAX_ENTRIES:
            raise BadRecord(f"node {label!r}: {len(txt)} TXT entries (at most {MAX_ENTRIES})")
        fields: dict[str, str] = {}
        size = 0
        for key, value in txt.items():
            value = value or b""
            entry = len(key) + 1 + len(value)
            size += entry + 1
            if entry > MAX_ENTRY:
                raise BadRecord(f"node {label!r}: TXT entry {key[:20]!r} is {entry} bytes (at most {MAX_ENTRY})")
            try:
                k, v = key.decode("ascii").lower(), value.decode("utf-8")
            except UnicodeDecodeError:
                raise BadRecord(f"node {label!r}: TXT entry {key[:20]!r} is not text") from None
            if any(ord(c) < 32 or ord(c) == 127 for c in k + v):
                raise BadRecord(f"node {label!r}: TXT entry {k!r} holds control characters")
            fields[k] = v
        if size > MAX_RECORD:
            raise BadRecord(f"node {label!r}: TXT record is {size} bytes (at most {MAX_RECORD})")

        def need(key: str, pattern: re.Pattern) -> str:
            value = fields.get(key)
            if value is None:
                raise BadRecord(f"node {label!r}: TXT record lacks {key!r}")
            if not pattern.fullmatch(value):
                raise BadRecord(f"node {label!r}: TXT {key!r} is malformed: {value[:40]!r}")
            return value

        if not 0 < port < 65536:
            raise BadRecord(f"node {label!r}: port {port} out of range")
        node, fleet, version = need("id", _NODE_ID), need("fleet", _FLEET_ID), int(need("v", _INT))
        ints = {key: int(need(key, _INT)) for key in ("cores", "mem", "avail")}
        names = {key: fields.get(key, "")[:CLIP[key]] for key in ("name", "os", "cpu", "ov", "st")}
        if not _INT8_DOT.fullmatch(fields.get("i8", "")):
            raise BadRecord(f"node {label!r}: TXT 'i8' is malformed: {fields['i8'][:40]!r}")
        if not _KERNEL_PATH.fullmatch(fields.get("kp", "")):
            raise BadRecord(f"node {label!r}: TXT 'kp' is malformed: {fields['kp'][:40]!r}")
        return cls(node_id=node, name=names["name"] or label, os=names["os"], cpu=names["cpu"],
                   cores=ints["cores"], memory_mb=ints["mem"], available_mb=ints["avail"], openvino=names["ov"],
                   devices=_decode_devices(label, fields), port=port, fleet_id=fleet,
                   addresses=_valid_addresses(addresses), version=version, status=names["st"],
                   simulated=fields.get("sim") == "1", int8_dot=fields.get("i8", ""), kernels=fields.get("kp", ""))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "NodeInfo":
        data = json.loads(text)
        kinds = {"cores": int, "memory_mb": int, "available_mb": int, "port": int, "version": int,
                 "devices": list, "addresses": list, "simulated": bool}
        if not isinstance(data, dict):
            raise BadRecord("node JSON is not an object")
        known = {f.name for f in dataclasses.fields(cls)}
        for key, value in data.items():
            if key in known and not isinstance(value, kinds.get(key, str)):
                raise BadRecord(f"node JSON field {key!r} has type {type(value).__name__}")
        try:
            return cls(**{k: v for k, v in data.items() if k in known})
        except TypeError as exc:
            raise BadRecord(f"node JSON: {exc}") from None


def _clip(text: str, limit: int) -> str:
    return text.encode()[:limit].decode(errors="ignore")


def _decode_devices(label: str, fields: dict[str, str]) -> list[dict]:
    listed = fields.get("dev", "")
    parts = listed.split(",") if listed else []
    if len(parts) > MAX_DEVICES:
        raise BadRecord(f"node {label!r}: {len(parts)} devices (at most {MAX_DEVICES})")
    devices = []
    for i, part in enumerate(parts):
        dev, sep, memory = part.partition(":")
        if not _DEVICE.fullmatch(dev) or (sep and not _INT.fullmatch(memory)):
            raise BadRecord(f"node {label!r}: device entry {part[:40]!r} is malformed")
        devices.append({"name": dev, "full_name": fields.get(f"d{i}", "")[:CLIP["full_name"]],
                        "memory_mb": int(memory) if sep else None})
    return devices


def _valid_addresses(addresses: list[str]) -> list[str]:
    good = []
    for address in addresses:
        try:
            good.append(str(ipaddress.ip_address(address)))
        except ValueError:
            log.debug("dropping malformed address %r", address)
    return good


def local_node_info(port: int, fleet_id: str, name: str | None = None, *, node: str | None = None,
                    simulated: SimulatedDevice | None = None) -> NodeInfo:
    """This machine's facts; the display name defaults to the host name, the id to the machine's.
    ``simulated``: a demo node's device, reported instead of the real ones, its memory as the node's."""
    total, available = (size >> 20 for size in process_memory())
    openvino, devices = _openvino_devices()
    cpu = cpu_model(next((d["full_name"] for d in devices if d["name"] == "CPU" and d["full_name"]), ""))
    if simulated is not None:
        total, available = simulated.memory_mb, min(available, simulated.memory_mb)
        devices, cpu = [simulated.device()], f"simulated on {cpu}"
    return NodeInfo(node_id=node or node_id(), name=name or socket.gethostname().split(".")[0], os=_os_name(),
                    cpu=cpu, cores=process_cores(), memory_mb=total,
                    available_mb=available, openvino=openvino, devices=devices, port=port, fleet_id=fleet_id,
                    simulated=simulated is not None, int8_dot="" if simulated else int8_dot(),
                    kernels="" if simulated or not openvino else _kernel_path())


def runs_slowly(int8: str, kernels: str) -> bool:
    """Whether a node's CPU runs OpenVINO's compressed matrices slowly: it has no int8 dot products
    and its stages do not run our kernels (or it does not say which kernels run them)."""
    return int8 == NONE and kernels != GGML


def _kernel_path() -> str:
    """Which kernels this machine's CPU stages run (``engine.kernels.path``; OpenVINO is there)."""
    from engine import kernels  # deferred: loads the extension into the shared Core
    from engine.runtime.stages.stage import core

    return kernels.path(core())[0]


def _os_name() -> str:
    system = platform.system()
    if system == "Windows":
        # platform.release() says "10" on Windows 11 in older Pythons; build 22000 and later is 11.
        build = platform.version().split(".")[-1]
        release = "11" if build.isdigit() and int(build) >= 22000 else platform.release()
        return f"Windows {release}"
    if system == "Darwin":
        return f"macOS {platform.mac_ver()[0]}"
    match = re.match(r"\d+\.\d+", platform.release())
    return f"{system} {match.group(0) if match else platform.release()}"


def _openvino_devices() -> tuple[str, list[dict]]:
    try:
        # deferred into the try: a missing or broken OpenVINO leaves the node reporting no devices, not failing
        import openvino

        # (the shared Core's module imports OpenVINO too)
        from engine.runtime.stages.stage import core as shared_core, devices as listed

        core = shared_core()  # one Core per process: creating one forks a short-lived child each time
        names = listed()  # listed once: each listing loads (or fails to load) every plugin again
    except Exception as exc:  # a broken driver or plugin raises all sorts; the node still serves on CPU
        log.warning("OpenVINO devices unavailable: %s", exc)
        return "", []
    version = openvino.get_version().split("-")[0]

    def prop(device: str, key: str):
        try:
            return core.get_property(device, key)
        except Exception:  # not every device has every property
            return None

    devices = []
    for device in names:
        total = prop(device, "GPU_DEVICE_TOTAL_MEM_SIZE") if device.startswith("GPU") else None
        devices.append({"name": device, "full_name": str(prop(device, "FULL_DEVICE_NAME") or ""),
                        "memory_mb": int(total) >> 20 if isinstance(total, int) else None})
    return version, devices
