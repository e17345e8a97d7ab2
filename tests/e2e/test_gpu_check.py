"""The GPU check's preparation, without a GPU or the network: benchmarks/gpu_wheels_check.py
on hand-made wheels, and benchmarks/gpu.sh's refusals (exit 2, one `error:` line)."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import train_proc

ROOT = Path(train_proc.ROOT)
TAG = "cp312-cp312-manylinux_2_28_x86_64"
# what benchmarks/gpu_wheels.sh carries: name, version, tag, Requires-Dist
WHEELS = [("grain", "0.2.18", TAG, ["absl-py", "array-record>=0.8.1; sys_platform != 'win32'",
                                    "etils[epath,epy]", "portpicker", "protobuf>=5.28.3",
                                    "pyarrow; extra == 'parquet'"]),
          ("array_record", "0.8.6", TAG, ["absl-py", "etils[epath]"]),
          ("portpicker", "1.6.0", "py3-none-any", ["psutil"]),
          ("tensorboardx", "2.6.5", "py3-none-any", ["numpy", "packaging", "protobuf>=3.20"])]


def _wheel(folder: Path, name: str, version: str, tag: str, requires: list[str]) -> None:
    meta = "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(folder / f"{name}-{version}-{tag}.whl", "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA",
                   f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{meta}")


def _check(folder: Path):
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_wheels_check.py"),
                           str(folder)], capture_output=True, text=True, timeout=60)


def test_wheels_and_image_hold_every_dependency(tmp_path):
    for w in WHEELS:
        _wheel(tmp_path, *w)
    r = _check(tmp_path)
    assert r.returncode == 0, r.stderr
    assert "4 wheels" in r.stdout and "grain==0.2.18" in r.stdout


@pytest.mark.parametrize("change, message", [
    (lambda ws: [w for w in ws if w[0] != "portpicker"],
     "portpicker (needed by grain-0.2.18"),
    (lambda ws: [("grain", "0.2.17", *ws[0][2:]), *ws[1:]],
     "pyproject.toml asks grain==0.2.18, the wheel is 0.2.17"),
    (lambda ws: [*ws, ("grain", "0.2.17", *ws[0][2:])], "two wheels of grain"),
    (lambda ws: [*ws[:1], ("array_record", "0.8.6", "cp311-cp311-manylinux_2_28_x86_64", []),
                 *ws[2:]], "does not install on CPython 3.12"),
    (lambda ws: ws[1:], "grain (needed by pyproject.toml) is neither in the image nor a wheel"),
])
def test_wheels_check_names_what_is_wrong(tmp_path, change, message):
    for w in change(WHEELS):
        _wheel(tmp_path, *w)
    r = _check(tmp_path)
    assert r.returncode == 2
    assert any(line.startswith("error: ") and message in line
               for line in r.stderr.splitlines()), r.stderr


def _gpu_sh(tmp_path, **env):
    return subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu.sh"), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "GPU_DRY_RUN": "1", **env})


def test_gpu_sh_refuses_without_wheels(tmp_path):
    r = _gpu_sh(tmp_path, WHEELS=str(tmp_path / "none"))
    assert r.returncode == 2
    assert f"error: no wheels in {tmp_path / 'none'}; run benchmarks/gpu_wheels.sh" in r.stderr


def test_gpu_sh_refuses_a_python_other_than_the_images(tmp_path):
    (tmp_path / "w").mkdir()
    _wheel(tmp_path / "w", *WHEELS[2])
    fake = tmp_path / "python"  # reports Python 3.11
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    r = _gpu_sh(tmp_path, WHEELS=str(tmp_path / "w"), PY=str(fake))
    assert r.returncode == 2
    assert f"error: {fake} is not Python 3.12" in r.stderr


def test_gpu_sh_keeps_a_folder_it_did_not_write(tmp_path):
    """An output folder that holds the user's files is refused before anything is written
    (exit 2, one error line), whatever else is missing; FORCE=1 goes past the check (here to
    the next refusal), and so does a folder gpu.sh made (its marker file)."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "gpu.log").write_text("the user's log")
    r = _gpu_sh(tmp_path, WHEELS=str(tmp_path / "none"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert f"error: {tmp_path / 'out'} holds files gpu.sh did not write" in r.stderr
    assert (tmp_path / "out" / "gpu.log").read_text() == "the user's log"
    assert sorted(os.listdir(tmp_path / "out")) == ["gpu.log"]
    for env in ({"FORCE": "1"}, {}):
        if not env:
            (tmp_path / "out" / ".made_by_gpu_sh").write_text("")
        r = _gpu_sh(tmp_path, WHEELS=str(tmp_path / "none"), **env)
        assert r.returncode == 2 and "error: no wheels in" in r.stderr, env
    (tmp_path / "file").write_text("x")
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu.sh"), str(tmp_path / "file")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "is a file, not a folder" in r.stderr
