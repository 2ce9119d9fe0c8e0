#!/usr/bin/env python3
"""Build an offline wheelhouse for an air-gapped GPU host (default target: the H200 image).

    python scripts/offline_bundle.py resolve   # download the pins into .whl/, check the closure
    python scripts/offline_bundle.py build     # resolve, repack, compress, write .c1/ .c2/ ...

Every pin of deploy/offline/gpu-requirements.txt is downloaded as a wheel for the target
(`pip download --no-deps`), then every Requires-Dist of every wheel (markers evaluated for the
target, extras as requested) must be met by a wheel of the set or by a package of the image list.
`build` re-stores the wheels uncompressed (dropping files the target never loads, see TRIM),
packs them into one tar.xz split into chunk folders for size-limited transfers;
scripts/offline_install.sh reassembles and installs them on the host.
"""
from __future__ import annotations

import argparse
import email.parser
import hashlib
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from email.message import Message
from pathlib import Path
from typing import IO, cast

from packaging import tags
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
OFFLINE = ROOT / "deploy" / "offline"
MIB = 1 << 20

# Files dropped from wheels because the target never loads them: in vllm the FlashAttention 2
# library (Hopper uses FA3; the import is guarded), the optional Rust frontend binary and the
# Blackwell-only FMHA sources; xgrammar's static library (for C++ builds); Ray's Java worker jars.
# Extension modules built for other Python versions are dropped from every wheel.
TRIM: dict[str, tuple[str, ...]] = {
    "vllm": ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm-rs",
             "vllm/third_party/fmha_sm100/"),
    "xgrammar": ("xgrammar/lib/",),
    "ray": ("ray/jars/",),
}
OTHER_PY = re.compile(r"\.cpython-(\d+)-")


@dataclass(frozen=True)
class Target:
    """The interpreter and platform the wheels are for."""

    python: str  # full version, e.g. "3.12.3"
    glibc: str  # e.g. "2.39"
    arch: str  # e.g. "x86_64"

    @property
    def py_mm(self) -> tuple[int, int]:
        major, minor = Version(self.python).release[:2]
        return major, minor

    @property
    def py_dotted(self) -> str:
        return "{}.{}".format(*self.py_mm)

    @property
    def py_nodot(self) -> str:
        return "{}{}".format(*self.py_mm)

    @property
    def platforms(self) -> list[str]:
        """manylinux tags from the target's glibc down, most preferred first."""
        major, minor = (int(x) for x in self.glibc.split(".")[:2])
        out = [f"manylinux_{major}_{m}_{self.arch}" for m in range(minor, 4, -1)]
        legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
        return out + [f"{name}_{self.arch}" for m, name in legacy.items() if m <= minor]

    def supported_tags(self) -> set[tags.Tag]:
        abi = f"cp{self.py_nodot}"
        found = tags.cpython_tags(self.py_mm, [abi, "abi3", "none"], self.platforms)
        found_compat = tags.compatible_tags(self.py_mm, abi, self.platforms)
        return set(found) | set(found_compat)

    def marker_env(self, extra: str = "") -> dict[str, str]:
        return {
            "implementation_name": "cpython",
            "implementation_version": self.python,
            "os_name": "posix",
            "platform_machine": self.arch,
            "platform_python_implementation": "CPython",
            "platform_release": "",
            "platform_system": "Linux",
            "platform_version": "",
            "python_full_version": self.python,
            "python_version": self.py_dotted,
            "sys_platform": "linux",
            "extra": extra,
        }


@dataclass(frozen=True)
class Pin:
    """One `name[extras]==version` line of the requirements file."""

    name: str  # canonical
    version: Version
    extras: frozenset[str]
    line: str


@dataclass
class Wheel:
    """A downloaded wheel and the metadata the closure check reads."""

    name: str
    version: Version
    path: Path
    requires: list[Requirement]
    requires_python: str | None
    extras: set[str] = field(default_factory=set)  # Provides-Extra


def read_pins(path: Path) -> dict[str, Pin]:
    """Parse exact pins; reject anything but `==` and duplicate names."""
    pins: dict[str, Pin] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        if len(specs) != 1 or specs[0].operator != "==" or "*" in specs[0].version:
            sys.exit(f"{path.name}: not an exact pin: {line}")
        name = canonicalize_name(req.name)
        if name in pins:
            sys.exit(f"{path.name}: {name} is pinned twice")
        extras = frozenset(canonicalize_name(e) for e in req.extras)
        pins[name] = Pin(name, Version(specs[0].version), extras, line)
    return pins


def read_names(path: Path) -> dict[str, Version | None]:
    """Parse a `name` or `name==version` per line list (comments allowed)."""
    out: dict[str, Version | None] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            name, _, ver = line.partition("==")
            out[canonicalize_name(name.strip())] = Version(ver.strip()) if ver else None
    return out


def wheel_metadata(path: Path) -> Message:
    with zipfile.ZipFile(path) as zf:
        meta = [n for n in zf.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
        if len(meta) != 1:
            raise ValueError(f"{path.name}: expected one .dist-info/METADATA, found {meta}")
        return email.parser.BytesParser().parsebytes(zf.read(meta[0]), headersonly=True)


def load_wheel(path: Path) -> Wheel:
    name, version, _, _ = parse_wheel_filename(path.name)
    meta = wheel_metadata(path)
    return Wheel(
        name=canonicalize_name(name),
        version=version,
        path=path,
        requires=[Requirement(r) for r in meta.get_all("Requires-Dist") or []],
        requires_python=meta.get("Requires-Python"),
        extras={canonicalize_name(e) for e in meta.get_all("Provides-Extra") or []},
    )


def find_wheels(cache: Path, pins: dict[str, Pin], target: Target) -> dict[str, Path]:
    """Wheels in `cache` that match a pin and install on the target."""
    supported = target.supported_tags()
    found: dict[str, Path] = {}
    for path in sorted(cache.glob("*.whl")):
        name, version, _, wtags = parse_wheel_filename(path.name)
        pin = pins.get(canonicalize_name(name))
        if pin and version == pin.version and wtags & supported:
            found.setdefault(pin.name, path)
    return found


def pip_download_cmd(target: Target, dest: Path, reqfile: Path) -> list[str]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--python-version", target.py_dotted,
           "--implementation", "cp", "-d", str(dest), "-r", str(reqfile)]
    for plat in target.platforms:
        cmd += ["--platform", plat]
    return cmd


def download(pins: dict[str, Pin], cache: Path, target: Target, jobs: int) -> dict[str, Path]:
    """Fetch the pins not yet in `cache`: batches of pins, one pip call each, `jobs` at a time."""
    cache.mkdir(parents=True, exist_ok=True)
    have = find_wheels(cache, pins, target)
    todo = sorted((p for n, p in pins.items() if n not in have), key=lambda p: p.name != "vllm")
    size = max(1, -(-len(todo) // (4 * jobs)))
    batches = [todo[i:i + size] for i in range(0, len(todo), size)]
    failed: list[str] = []

    def fetch(batch: list[Pin]) -> int:
        with tempfile.NamedTemporaryFile("w", suffix=".txt") as req:
            req.write("".join(p.line + "\n" for p in batch))
            req.flush()
            run = subprocess.run(pip_download_cmd(target, cache, Path(req.name)),
                                 check=False, capture_output=True, text=True)
        if run.returncode != 0:
            tail = (run.stdout + run.stderr).splitlines()[-5:]
            lines = " ".join(p.line for p in batch)
            failed.append(f"pip download exit {run.returncode} for {lines}\n  " + "\n  ".join(tail))
        return len(batch)

    if todo:
        with ThreadPoolExecutor(jobs) as pool, \
                tqdm(total=len(pins), initial=len(have), unit="whl", desc="download") as bar:
            for fut in as_completed([pool.submit(fetch, b) for b in batches]):
                bar.update(fut.result())
    if failed:
        sys.exit("\n".join(failed))
    have = find_wheels(cache, pins, target)
    absent = sorted(set(pins) - set(have))
    if absent:
        sys.exit(f"no wheel for the target after download: {', '.join(absent)}")
    return have


def _applies(req: Requirement, extras: Iterable[str], target: Target) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate(target.marker_env(e)) for e in {"", *extras})


def check_closure(wheels: dict[str, Wheel], pins: dict[str, Pin], image: dict[str, Version | None],
                  skipped: dict[str, Version | None], target: Target) -> list[str]:
    """Problems with the set's Requires-Dist closure (empty when it is complete); prints notes."""
    extras = {n: set(p.extras) for n, p in pins.items()}
    changed = True
    while changed:  # propagate extras requested by requirers (e.g. uvicorn[standard])
        changed = False
        for w in wheels.values():
            for req in w.requires:
                dep = canonicalize_name(req.name)
                new = {canonicalize_name(e) for e in req.extras} - extras.get(dep, set())
                if dep in wheels and new and _applies(req, extras[w.name], target):
                    extras[dep] |= new
                    changed = True

    problems: list[str] = []
    not_bundled: dict[str, set[str]] = {}
    required: set[str] = set()
    image_rejected: set[str] = set()  # pinned names whose image version some requirer rejects
    py = Version(target.python)
    for w in sorted(wheels.values(), key=lambda w: w.name):
        if w.requires_python and not SpecifierSet(w.requires_python).contains(py, prereleases=True):
            problems.append(f"{w.name} {w.version}: Requires-Python {w.requires_python}")
        for bad in sorted(extras[w.name] - w.extras):
            print(f"note: {w.name} {w.version} has no extra [{bad}]")
        for req in w.requires:
            if not _applies(req, extras[w.name], target):
                continue
            dep = canonicalize_name(req.name)
            who = f"{w.name} {w.version} requires {req}"
            required.add(dep)
            if dep in wheels:
                if not req.specifier.contains(wheels[dep].version, prereleases=True):
                    problems.append(f"conflict: {who}, the set has {dep}=={wheels[dep].version}")
                if dep in image and image[dep] is not None and \
                        not req.specifier.contains(image[dep], prereleases=True):
                    image_rejected.add(dep)
            elif dep in skipped:
                not_bundled.setdefault(dep, set()).add(w.name)
            elif dep in image:
                have = image[dep]
                if have is not None and not req.specifier.contains(have, prereleases=True):
                    problems.append(f"conflict: {who}, the image has {dep}=={have}: pin one")
            else:
                problems.append(f"missing: {who}")
    for dep, by in sorted(not_bundled.items()):
        print(f"not bundled (declared): {dep}  <- {', '.join(sorted(by))}")
    for name in sorted(set(wheels) & set(image)):
        if name not in image_rejected:
            print(f"note: {name} is on the image at {image[name]} and nothing here rejects that "
                  "version: the pin may be dropped")
    top = sorted(set(wheels) - required)
    print(f"top level (required by nothing in the set): {', '.join(top)}")
    return problems


def resolve(args: argparse.Namespace) -> dict[str, Wheel]:
    """Download the pins and check the closure; exit non-zero on any problem."""
    target = Target(args.python, args.glibc, args.arch)
    pins = read_pins(args.requirements)
    image, skipped = read_names(args.image), read_names(args.not_bundled)
    paths = download(pins, args.cache, target, args.jobs)
    wheels = {n: load_wheel(p) for n, p in tqdm(paths.items(), unit="whl", desc="read metadata")}
    problems = check_closure(wheels, pins, image, skipped, target)
    total = sum(p.stat().st_size for p in paths.values())
    print(f"{len(wheels)} wheels, {total / MIB:.1f} MiB; image list: {len(image)} packages")
    if problems:
        print("\n".join(problems), file=sys.stderr)
        sys.exit(f"closure check failed: {len(problems)} problem(s)")
    print("closure check: OK")
    return wheels


Members = list[zipfile.ZipInfo]


def split_members(wheel: Wheel, target: Target) -> tuple[Members, Members]:
    """The wheel's members to keep and to drop (TRIM, extensions for other Pythons)."""
    own = target.py_nodot
    drop = TRIM.get(wheel.name, ())
    kept: Members = []
    gone: Members = []
    with zipfile.ZipFile(wheel.path) as zf:
        for info in zf.infolist():
            other = OTHER_PY.search(info.filename)
            bad = info.filename.startswith(drop) or (other is not None and other.group(1) != own)
            (gone if bad else kept).append(info)
    return kept, gone


def restore_wheel(wheel: Wheel, dst: Path, kept: Members) -> None:
    """Rewrite `wheel` to `dst` with only the `kept` members, stored uncompressed (xz then sees
    the raw bytes, which it compresses far better than deflate does); RECORD lists what is kept."""
    names = {i.filename for i in kept}
    with zipfile.ZipFile(wheel.path) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in kept:
            out = zipfile.ZipInfo(info.filename, info.date_time)
            out.external_attr = info.external_attr
            if re.fullmatch(r"[^/]+\.dist-info/RECORD", info.filename):
                rows = zin.read(info).decode().splitlines()
                zout.writestr(out, "".join(r + "\n" for r in rows if r.rsplit(",", 2)[0] in names))
                continue
            with zin.open(info) as fin, zout.open(out, "w", force_zip64=True) as fout:
                shutil.copyfileobj(fin, fout, 4 * MIB)


class _Counting:
    """A write-only file that counts bytes into a progress bar."""

    def __init__(self, raw: IO[bytes], bar: tqdm) -> None:
        self.raw, self.bar = raw, bar

    def write(self, data: bytes) -> int:
        self.raw.write(data)
        self.bar.update(len(data))
        return len(data)


def write_bundle(wheels: list[Wheel], target: Target, out: Path, preset: int) -> int:
    """Stream a tar of the re-stored wheels (under wheels/) through `xz -T0`; returns tar bytes.
    Each wheel is rewritten next to `out` just before it is added, so little disk is needed."""
    if shutil.which("xz") is None:
        sys.exit("xz is needed to compress the bundle")
    plan = []
    for w in tqdm(sorted(wheels, key=lambda w: w.path.name), unit="whl", desc="plan trims"):
        kept, gone = split_members(w, target)
        plan.append((w, kept))
        if gone:
            mib = sum(i.file_size for i in gone) / MIB
            print(f"{w.name}: dropping {len(gone)} files, {mib:.0f} MiB")
    total = sum(sum(i.file_size + 100 for i in kept) for _, kept in plan)
    tmp = out.with_suffix(".tmp.whl")
    with open(out, "wb") as sink, tqdm(total=total, unit="B", unit_scale=True,
                                       desc=f"store + xz -{preset}") as bar:
        xz = subprocess.Popen(["xz", "-T0", f"-{preset}", "-c"], stdin=subprocess.PIPE, stdout=sink)
        assert xz.stdin is not None
        counted = cast(IO[bytes], _Counting(xz.stdin, bar))
        with tarfile.open(fileobj=counted, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for w, kept in plan:
                restore_wheel(w, tmp, kept)
                info = tar.gettarinfo(tmp, arcname=f"wheels/{w.path.name}")
                info.uid = info.gid = 0
                info.uname = info.gname = "root"
                with open(tmp, "rb") as fh:
                    tar.addfile(info, fh)
                tmp.unlink()
        xz.stdin.close()
        if xz.wait() != 0:
            sys.exit(f"xz failed (exit {xz.returncode})")
        bar.total = bar.n
    return bar.n


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh, tqdm(total=path.stat().st_size, unit="B", unit_scale=True, desc="sha256") as bar:
        for block in iter(lambda: fh.read(8 * MIB), b""):
            h.update(block)
            bar.update(len(block))
    return h.hexdigest()


def split_chunks(bundle: Path, chunk_mib: int) -> list[Path]:
    """Write .c1/ .c2/ ... under ROOT, each at most chunk_mib MiB in all; the last one also
    holds bundle.sha256 and LAST (the number of chunks)."""
    for old in ROOT.iterdir():
        if old.is_dir() and re.fullmatch(r"\.c\d+", old.name):
            shutil.rmtree(old)
    part = chunk_mib * MIB - 4096  # room for bundle.sha256 and LAST
    size = bundle.stat().st_size
    count = -(-size // part)
    if count > 99:
        sys.exit(f"{count} chunks: raise --chunk-mib")
    dirs = []
    with open(bundle, "rb") as fh, tqdm(total=size, unit="B", unit_scale=True, desc="split") as bar:
        for i in range(1, count + 1):
            d = ROOT / f".c{i}"
            d.mkdir()
            with open(d / f"part.{i:02d}", "wb") as out:
                shutil.copyfileobj(_Limited(fh, part), cast(IO[bytes], _Counting(out, bar)), 8 * MIB)
            dirs.append(d)
    (dirs[-1] / "bundle.sha256").write_text(f"{sha256(bundle)}  bundle.tar.xz\n")
    (dirs[-1] / "LAST").write_text(f"{count}\n")
    return dirs


class _Limited:
    """A reader that stops after `left` bytes of `raw`."""

    def __init__(self, raw: IO[bytes], left: int) -> None:
        self.raw, self.left = raw, left

    def read(self, n: int = -1) -> bytes:
        n = self.left if n < 0 else min(n, self.left)
        data = self.raw.read(n)
        self.left -= len(data)
        return data


def build(args: argparse.Namespace) -> None:
    """resolve, re-store and trim the wheels, compress, split into chunk folders."""
    t0 = time.monotonic()
    wheels = resolve(args)
    target = Target(args.python, args.glibc, args.arch)
    stage = args.cache / ".stage"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    bundle = stage / "bundle.tar.xz"
    t1 = time.monotonic()
    raw = write_bundle(list(wheels.values()), target, bundle, args.xz_preset)
    t2 = time.monotonic()
    xz_mib = bundle.stat().st_size / MIB
    print(f"bundle: {len(wheels)} wheels, tar {raw / MIB:.0f} MiB -> {xz_mib:.1f} MiB "
          f"(xz -{args.xz_preset} -T0, {t2 - t1:.0f} s)")
    dirs = split_chunks(bundle, args.chunk_mib)
    for d in dirs:
        size = sum(f.stat().st_size for f in d.iterdir())
        names = " ".join(sorted(f.name for f in d.iterdir()))
        print(f"  {d.name}/  {size / MIB:5.1f} MiB  {names}")
    print(f"{len(dirs)} transfers of at most {args.chunk_mib} MiB, each with the checkout; on the "
          f"host: bash scripts/offline_install.sh recv N for N = 1..{len(dirs)}, then install. "
          f"Total {time.monotonic() - t0:.0f} s.")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, fn in (("resolve", resolve), ("build", build)):
        p = sub.add_parser(name, help=fn.__doc__.split("\n")[0])
        p.set_defaults(fn=fn)
        p.add_argument("--requirements", type=Path, default=OFFLINE / "gpu-requirements.txt",
                       help="exact pins of the wheels to bring")
        p.add_argument("--image", type=Path, default=OFFLINE / "h200-image-packages.txt",
                       help="packages the target already has (name or name==version per line)")
        p.add_argument("--not-bundled", type=Path, default=OFFLINE / "not-bundled.txt",
                       help="requirements left out on purpose")
        p.add_argument("--python", default="3.12.3", help="target Python version (full)")
        p.add_argument("--glibc", default="2.39", help="target glibc: manylinux tags up to it")
        p.add_argument("--arch", default="x86_64", help="target machine architecture")
        p.add_argument("--cache", type=Path, default=ROOT / ".whl", help="wheel download folder")
        p.add_argument("--jobs", type=int, default=4, help="parallel downloads")
        if name == "build":
            p.add_argument("--chunk-mib", type=int, default=56, help="largest chunk folder, MiB")
            p.add_argument("--xz-preset", type=int, default=1, choices=range(10),
                           help="xz preset; 1 compresses the set in about a minute on 2 cores, "
                           "higher ones gain a few %% for several times the time")
    args = ap.parse_args(argv)
    args.cache = args.cache.resolve()
    args.fn(args)


if __name__ == "__main__":
    main()
