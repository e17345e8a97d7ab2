"""Check a folder of wheels against the GPU image: together they must hold every dependency.

    python benchmarks/gpu_wheels_check.py .whl

Fails (exit 2, one `error:` line each) when a wheel does not install on the image (CPython 3.12,
manylinux x86_64), when two wheels carry one package, when a dependency in pyproject.toml or a
wheel's own Requires-Dist (extras off, markers for Linux / Python 3.12) is in neither the wheels
nor benchmarks/gpu_image_packages.txt, when a pyproject pin and its wheel disagree, or when the
folder is over 64 MiB (what one device call may carry). Prints each wheel and the total size.
Extras asked of an image package (grain's etils[epath,epy]) are taken as present: etils' epath
and epy extras need only fsspec, typing_extensions and zipp, which the image has.
"""

from __future__ import annotations

import re
import sys
import tomllib
import zipfile
from pathlib import Path

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename
except ImportError:  # pip always vendors packaging
    from pip._vendor.packaging.markers import default_environment
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 64 * 2**20
# the image's interpreter, not this one
ENV = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3",
       "implementation_name": "cpython", "platform_python_implementation": "CPython",
       "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
       "os_name": "posix", "extra": ""}


def image_packages() -> set[str]:
    lines = (ROOT / "benchmarks" / "gpu_image_packages.txt").read_text().splitlines()
    return {canonicalize_name(s) for s in (ln.strip() for ln in lines) if s and s[0] != "#"}


def installs_on_image(tags) -> bool:
    return any(t.interpreter in ("cp312", "py3", "py312") and t.abi in ("cp312", "abi3", "none")
               and (t.platform == "any" or re.fullmatch(r"manylinux\w*_x86_64", t.platform))
               for t in tags)


def requirements(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    reqs = [Requirement(ln.split(":", 1)[1].strip()) for ln in text.splitlines()
            if ln.startswith("Requires-Dist:")]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(ENV)]


def check(folder: Path) -> list[str]:
    errors, wheels = [], {}
    files = sorted(folder.glob("*.whl"))
    if not files:
        return [f"no wheels in {folder}; run benchmarks/gpu_wheels.sh"]
    for f in files:
        name, version, _, tags = parse_wheel_filename(f.name)
        if not installs_on_image(tags):
            errors.append(f"{f.name} does not install on CPython 3.12 manylinux x86_64")
        if name in wheels:
            errors.append(f"two wheels of {name}: {wheels[name][0]} and {version}; keep one")
        wheels[name] = (version, f)
    have = image_packages() | set(wheels)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    needs = [("pyproject.toml", Requirement(r)) for r in pyproject]
    needs += [(wheels[n][1].name, r) for n in wheels for r in requirements(wheels[n][1])]
    for who, req in needs:
        name = canonicalize_name(req.name)
        if name not in have:
            errors.append(f"{req.name} (needed by {who}) is neither in the image nor a wheel; "
                          f"add it to WHEELS in benchmarks/gpu_wheels.sh")
        elif name in wheels and not req.specifier.contains(wheels[name][0], prereleases=True):
            errors.append(f"{who} asks {req}, the wheel is {wheels[name][0]}; "
                          f"change its pin in benchmarks/gpu_wheels.sh")
    total = sum(f.stat().st_size for f in files)
    for n, (v, f) in sorted(wheels.items()):
        print(f"  {f.stat().st_size / 2**20:7.2f} MiB  {n}=={v}  {f.name}")
    print(f"  {total / 2**20:7.2f} MiB  total, {len(files)} wheels in {folder} "
          f"(limit {LIMIT / 2**20:.0f} MiB)")
    if total > LIMIT:
        errors.append(f"{folder} holds {total / 2**20:.1f} MiB, over the {LIMIT / 2**20:.0f} MiB "
                      "a device call carries; carry fewer wheels")
    return errors


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python benchmarks/gpu_wheels_check.py WHEEL_DIR", file=sys.stderr)
        return 2
    errors = check(Path(argv[0]))
    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    return 2 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
