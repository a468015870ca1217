"""`shoal doctor`'s checks of this machine: Python, shoal, torch and the training device, libp2p, addresses, disk,
identity. Each returns a Check with a verdict and, when it is not ok, the fix."""

from __future__ import annotations

import errno
import os
import platform
import shutil
import socket
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

VERDICTS = ("ok", "info", "warn", "fail")
MIN_PYTHON = (3, 11)
GB = 1e9
#: fastecdsa 2.3.2 (pinned by libp2p 0.8.1) publishes wheels for CPython 3.11 on Linux only; elsewhere pip compiles it
LIBP2P_BUILD_DEPS = {
    "debian": "sudo apt-get install -y build-essential python3-dev libgmp-dev",
    "fedora": "sudo dnf install -y gcc python3-devel gmp-devel",
    "macos": "xcode-select --install; brew install gmp",
}
CLOCK_FIX = "turn on time synchronization: `sudo timedatectl set-ntp true` (Linux) or `sudo sntp -sS time.apple.com` (macOS)"


@dataclass(frozen=True, kw_only=True, slots=True)
class Check:
    name: str
    verdict: str
    summary: str
    fix: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, not {self.verdict!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "verdict": self.verdict, "summary": self.summary, "fix": self.fix, "data": self.data}


def check_python() -> Check:
    v = sys.version_info
    data = {"version": platform.python_version(), "implementation": platform.python_implementation(),
            "system": platform.system(), "machine": platform.machine()}
    where = f"{data['implementation']} {data['version']} on {data['system']} {data['machine']}"
    if v[:2] < MIN_PYTHON:
        return Check(name="python", verdict="fail", summary=f"{where}: shoal needs Python 3.11 or newer",
                     fix="install Python 3.11 (the one shoal's dependencies ship wheels for) and a venv with it", data=data)
    return Check(name="python", verdict="ok", summary=where, data=data)


def check_shoal() -> Check:
    from shoal.node.version import shoal_version

    import shoal.node

    where = str(Path(shoal.node.__file__).resolve().parent.parent)
    return Check(name="shoal", verdict="ok", summary=f"shoal {shoal_version()} from {where}",
                 data={"version": shoal_version(), "path": where})


def libp2p_fix(system: str, version: tuple[int, int], have_compiler: bool, have_gmp: bool) -> str:
    """The exact fix when libp2p does not import (or installs) on this platform."""
    if system == "Linux" and version == (3, 11):
        return "pip install --force-reinstall 'libp2p==0.8.1' (its fastecdsa 2.3.2 has a wheel for Python 3.11 on Linux)"
    missing = [what for what, have in (("a C compiler", have_compiler), ("the GMP headers (gmp.h)", have_gmp)) if not have]
    why = (f"fastecdsa 2.3.2 (pinned by libp2p 0.8.1) ships wheels only for CPython 3.11 on Linux, so pip compiles it "
           f"here{': this machine lacks ' + ' and '.join(missing) if missing else ''}. ")
    if system == "Darwin":
        steps = (f"{LIBP2P_BUILD_DEPS['macos']}; then CFLAGS=-I$(brew --prefix gmp)/include "
                 f"LDFLAGS=-L$(brew --prefix gmp)/lib pip install --no-cache-dir fastecdsa==2.3.2 && pip install shoal")
    else:
        steps = (f"Debian/Ubuntu: {LIBP2P_BUILD_DEPS['debian']} · Fedora: {LIBP2P_BUILD_DEPS['fedora']}; "
                 f"then pip install --no-cache-dir fastecdsa==2.3.2 && pip install shoal")
    return why + steps + " (or use Python 3.11 on Linux, or the compose image)"


def have_gmp_headers() -> bool:
    roots = ["/usr/include", "/usr/local/include", "/opt/homebrew/include", "/opt/local/include"]
    roots += [f"/usr/include/{platform.machine()}-linux-gnu"]
    return any(Path(r, "gmp.h").exists() for r in roots)


def check_libp2p() -> Check:
    from importlib.metadata import PackageNotFoundError, version

    system, pyver = platform.system(), sys.version_info[:2]
    try:
        import fastecdsa  # noqa: F401 - the import that fails when it was never built
        import libp2p  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure to import is the finding
        have_cc = any(shutil.which(c) for c in ("cc", "gcc", "clang"))
        return Check(name="libp2p", verdict="fail", summary=f"libp2p does not import: {type(e).__name__}: {e}",
                     fix=libp2p_fix(system, pyver, have_cc, have_gmp_headers()),
                     data={"error": f"{type(e).__name__}: {e}", "compiler": have_cc, "gmp_headers": have_gmp_headers()})
    try:
        versions = {p: version(p) for p in ("libp2p", "fastecdsa")}
    except PackageNotFoundError:
        versions = {}
    return Check(name="libp2p", verdict="ok",
                 summary=f"libp2p {versions.get('libp2p', '?')} imports (fastecdsa {versions.get('fastecdsa', '?')})",
                 data=versions)


def available_memory_bytes() -> int:
    """System memory available to a new process (MemAvailable), or the free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError):
        return 0


def nvidia_driver_present() -> bool:
    return Path("/proc/driver/nvidia/version").exists() or shutil.which("nvidia-smi") is not None


def check_torch(device_flag: str) -> list[Check]:
    """torch itself, the device `shoal node --device device_flag` trains on (with its free memory), and the model
    presets that fit there."""
    from shoal.node.doctor.fit import fits

    try:
        import torch
    except Exception as e:  # noqa: BLE001
        return [Check(name="torch", verdict="fail", summary=f"torch does not import: {type(e).__name__}: {e}",
                      fix="pip install torch==2.13.0 (CPU), or the CUDA build from https://download.pytorch.org/whl/cu128")]
    cuda_build = torch.version.cuda
    cuda_ok = torch.cuda.is_available()
    out = [Check(name="torch", verdict="ok",
                 summary=f"torch {torch.__version__} ({'CUDA ' + cuda_build if cuda_build else 'CPU build'})"
                         f"{', ' + str(torch.cuda.device_count()) + ' CUDA device(s)' if cuda_ok else ''}",
                 data={"version": torch.__version__, "cuda_build": cuda_build, "cuda_available": cuda_ok,
                       "cuda_devices": torch.cuda.device_count() if cuda_ok else 0})]
    if not cuda_build and nvidia_driver_present():
        out[0] = Check(name="torch", verdict="warn", summary=out[0].summary + ", but this machine has an NVIDIA driver",
                       fix="install torch's CUDA build to train on the GPU: pip install torch --index-url "
                           "https://download.pytorch.org/whl/cu128", data=out[0].data)
    from shoal.node.train.device import resolve_device

    try:
        device = str(resolve_device(device_flag))
    except ValueError as e:  # DeviceUnavailable included
        return out + [Check(name="device", verdict="fail", summary=str(e),
                            fix="drop --device (auto: the GPU if torch sees one, else the CPU), or install a CUDA "
                                "build of torch and the driver", data={"device": device_flag})]
    if device.startswith("cuda"):
        dev = torch.device(device)
        free, total = torch.cuda.mem_get_info(dev)
        name = torch.cuda.get_device_name(dev)
    else:
        free, total = available_memory_bytes(), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        name = f"{platform.machine()} CPU, {os.cpu_count()} cores"
    note, fix = "", ""
    if device == "cpu" and cuda_ok:
        note = f" ({torch.cuda.get_device_name(0)} is idle: pass --device cuda)"
        fix = "shoal node --device cuda … trains on the GPU"
    out.append(Check(name="device", verdict="warn" if fix else "ok",
                     summary=f"a node trains on {device}: {name}, {free / GB:.1f} of {total / GB:.1f} GB free{note}",
                     fix=fix, data={"device": device, "name": name, "free_bytes": int(free), "total_bytes": int(total)}))
    table = fits(int(free))
    fitting = [f.size for f in table if f.fits]
    verdict = "fail" if not fitting else "ok"
    out.append(Check(name="models", verdict=verdict, summary="; ".join(f.describe() for f in table) + " (estimated)",
                     fix="" if fitting else "free memory, or use a GPU with more memory",
                     data={"fits": fitting, "sizes": {f.size: {"params": f.params, "max_micro_batch": f.max_micro_batch}
                                                      for f in table}}))
    return out


def check_listen(listen: str) -> Check:
    """This machine's addresses with their scope, and whether the --listen port can be bound."""
    from shoal.swarm.net.addresses import local_ipv4, scope

    ips = {ip: scope(ip) for ip in local_ipv4()}
    parts = listen.strip("/").split("/")
    host, port = (parts[1], int(parts[3])) if len(parts) >= 4 and parts[0] == "ip4" and parts[2] == "tcp" else ("", -1)
    data: dict[str, Any] = {"listen": listen, "addresses": ips}
    if port < 0:
        return Check(name="listen", verdict="fail", summary=f"--listen {listen}: not /ip4/ADDR/tcp/PORT",
                     fix="use e.g. --listen /ip4/0.0.0.0/tcp/4001", data=data)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            return Check(name="listen", verdict="warn", summary=f"TCP port {port} is taken on {host}",
                         fix="fine if it is this machine's running shoal node; otherwise pick another port", data=data)
        return Check(name="listen", verdict="fail", summary=f"cannot listen on {host}:{port}: {e.strerror}",
                     fix="pick a free port (another shoal node may hold this one) or an address of this machine",
                     data=data)
    shown = ", ".join(f"{ip} {sc}" for ip, sc in ips.items())
    reachable = [ip for ip, sc in ips.items() if sc != "loopback"] if host == "0.0.0.0" else [host]
    scopes = {ips.get(ip, scope(ip)) for ip in reachable}
    if not reachable or scopes == {"loopback"}:
        return Check(name="listen", verdict="warn", summary=f"{listen}: only this machine can dial it ({shown})",
                     fix="listen on /ip4/0.0.0.0/tcp/4001 so other machines can join", data=data)
    if "public" in scopes:
        return Check(name="listen", verdict="ok", summary=f"{listen}: public address, others can dial it if TCP {port} "
                     f"is open in the firewall ({shown})", data=data)
    return Check(name="listen", verdict="info",
                 summary=f"{listen}: private addresses only ({shown}): machines on the same network dial it; peers "
                         f"elsewhere reach it through a relay and hole punching, with nothing to configure",
                 fix=f"optional: to be dialable from anywhere (and relay for others), forward TCP port "
                     f"{port if port else 4001} on your router to this machine and listen on that fixed port",
                 data=data)


def check_disk(home: Path) -> Check:
    from shoal.node.doctor.fit import fit

    probe = home
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    # a checkpoint holds the weights and the optimizer (16 bytes per parameter); a run keeps the last 3
    need = {size: 3 * 16 * fit(size, 0).params for size in ("tiny", "small", "base")}
    room = [s for s, n in need.items() if n <= free]
    data = {"path": str(home), "free_bytes": free, "checkpoints_bytes": need}
    summary = f"{free / GB:.1f} GB free at {probe}; 3 checkpoints of " + ", ".join(
        f"{s} {n / GB:.2g} GB" for s, n in need.items())
    if not room:
        return Check(name="disk", verdict="fail", summary=summary, fix=f"free disk space at {probe}, or set SHOAL_HOME "
                     f"to a disk with room", data=data)
    if "base" not in room:
        return Check(name="disk", verdict="warn", summary=summary + f": room for {', '.join(room)} only",
                     fix="free disk space, or set SHOAL_HOME elsewhere, before training bigger models", data=data)
    return Check(name="disk", verdict="ok", summary=summary, data=data)


def check_identity(path: Path) -> Check:
    """The key file: present, a valid Ed25519 seed, readable by its owner only. Read without libp2p, so this
    check works when libp2p does not import."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from shoal.protocol.signing import peer_id_from_public_key, public_key_bytes

    data: dict[str, Any] = {"path": str(path)}
    if not path.exists():
        return Check(name="identity", verdict="info", summary=f"no identity at {path} yet: `shoal node` creates one "
                     "(mode 0600) on its first start", data=data)
    st = path.stat()
    mode = stat.S_IMODE(st.st_mode)
    data.update(mode=oct(mode), owner_uid=st.st_uid)
    try:
        seed = path.read_bytes()
        if len(seed) != 32:
            raise ValueError(f"expected a 32-byte Ed25519 seed, found {len(seed)} bytes")
        peer_id = peer_id_from_public_key(public_key_bytes(Ed25519PrivateKey.from_private_bytes(seed)))
    except (ValueError, OSError) as e:
        return Check(name="identity", verdict="fail", summary=f"{path}: {e}",
                     fix="move it away; `shoal node` then creates a new identity (a new peer id)", data=data)
    data["peer_id"] = peer_id
    if mode & 0o077:
        return Check(name="identity", verdict="fail",
                     summary=f"{path} (peer {peer_id}) is readable by others (mode {oct(mode)}): anyone who reads it "
                             "can act as this node", fix=f"chmod 600 {path}", data=data)
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return Check(name="identity", verdict="warn", summary=f"{path} (peer {peer_id}) belongs to uid {st.st_uid}, "
                     f"not to this user", fix=f"chown $(id -u) {path}", data=data)
    return Check(name="identity", verdict="ok", summary=f"{path}: peer {peer_id}, mode {oct(mode)}", data=data)
