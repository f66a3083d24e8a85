"""A PEP 517 build backend for the kvwire Python package, standard library only.

The package is Python over ctypes; the wheel carries the C library it loads. Building a
wheel (`pip install ./python`, `pip wheel ./python`) configures and builds the C
library with CMake in a scratch directory (`-DKVW_LIBRARY_ONLY=ON`: libkvwire.so and the
modules it loads at run time, nothing else) and puts into kvwire/:

  libkvwire.so        the library (the real file, not the SONAME links: a wheel keeps no
                      symbolic links); kvwire/_native.py loads it from there;
  libkvwire-ucx.so    the UCX transport module, when CMake found UCX;
  libkvwire_cuda.so   the CUDA module, when CMake found nvcc.

libkvwire.so loads both modules from its own directory (src/transport/tl_module.c,
src/cuda/module_load.h), so an installed package needs no environment variable. The
build needs only cmake and a C compiler (what `make` installs, scripts/install-deps.sh),
no network and no Python build dependencies (setuptools would need setuptools and
`wheel` inside pip's isolated build environment, downloaded).

The C sources: the repository around python/ (a source tree), or native/ inside an
sdist (build_sdist copies them there). A libkvwire.so copied into kvwire/ before building
is shipped as it is, and nothing is built. Settings, from the environment or pip's
--config-settings (`-C key=value`):

  KVWIRE_CMAKE_ARGS   extra arguments to CMake's configure, split on spaces (e.g.
                      "-DKVW_WITH_CUDA=OFF -DKVW_WITH_UCX=OFF");
  KVWIRE_BUILD_JOBS   parallel build jobs (default: the number of CPUs);
  KVWIRE_BUILD_DIR    build here and keep it (default: a scratch directory, removed).

`pip install -e ./python` (PEP 660) installs a path to this directory only; kvwire then
loads <repo>/build/libkvwire.so (`make build`).

Metadata comes from the [project] table of pyproject.toml (name, version,
description, requires-python, license) and README.md; the wheel carries LICENSE.
"""
import base64
import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = "kvwire"
# What build_sdist copies of the C tree into native/ (the build with KVW_LIBRARY_ONLY
# reads nothing else).
NATIVE_PARTS = ("CMakeLists.txt", "LICENSE", "cmake", "include", "src")


def _project():
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        text = f.read()
    try:
        import tomllib  # Python 3.11+
        return tomllib.loads(text)["project"]
    except ImportError:
        pass
    # Older Pythons: the few simple string keys of [project] this backend reads.
    m = re.search(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    body = m.group(1) if m else ""
    out = {}
    for key in ("name", "version", "description", "readme", "requires-python"):
        km = re.search(r'^%s\s*=\s*"([^"]*)"' % re.escape(key), body, re.M)
        if km:
            out[key] = km.group(1)
    lm = re.search(r'^license\s*=\s*\{\s*text\s*=\s*"([^"]*)"', body, re.M)
    if lm:
        out["license"] = lm.group(1)
    return out


def _meta():
    p = _project()
    name, version = p["name"], p["version"]
    lines = ["Metadata-Version: 2.1", "Name: " + name, "Version: " + version]
    if p.get("description"):
        lines.append("Summary: " + p["description"])
    if p.get("requires-python"):
        lines.append("Requires-Python: " + p["requires-python"])
    lic = p.get("license")
    if isinstance(lic, dict):
        lic = lic.get("text")
    if lic:
        lines.append("License: " + lic)
    for c in p.get("classifiers", []) or []:
        lines.append("Classifier: " + c)
    body = ""
    readme = p.get("readme")
    if isinstance(readme, str) and os.path.exists(os.path.join(ROOT, readme)):
        lines.append("Description-Content-Type: text/markdown")
        with open(os.path.join(ROOT, readme), encoding="utf-8") as f:
            body = f.read()
    return name, version, "\n".join(lines) + "\n\n" + body


def _package_files():
    out = []
    pdir = os.path.join(ROOT, PKG)
    for fn in sorted(os.listdir(pdir)):
        if fn.endswith(".py") or fn.endswith(".so") or fn == "py.typed":
            out.append((PKG + "/" + fn, os.path.join(pdir, fn)))
    return out


def _license():
    """The LICENSE file: next to pyproject.toml (sdist) or at the repository root."""
    for path in (os.path.join(ROOT, "LICENSE"), os.path.join(ROOT, "native", "LICENSE"),
                 os.path.join(os.path.dirname(ROOT), "LICENSE")):
        if os.path.isfile(path):
            return path
    return None


def _tag(files):
    if any(a.endswith(".so") for a, _ in files):
        plat = sysconfig.get_platform().replace("-", "_").replace(".", "_")
        return "py3-none-" + plat, False
    return "py3-none-any", True


def _record_line(arcname, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return "%s,sha256=%s,%d" % (arcname, digest, len(data))


def _write_wheel(wheel_directory, entries, tag, purelib):
    name, version, metadata = _meta()
    dist = "%s-%s" % (name.replace("-", "_"), version)
    info = dist + ".dist-info"
    wheel_txt = ("Wheel-Version: 1.0\nGenerator: kvwire_backend\nRoot-Is-Purelib: %s\n"
                 "Tag: %s\n" % ("true" if purelib else "false", tag))
    lic = _license()
    entries = list(entries) + ([(info + "/LICENSE", _read(lic))] if lic else []) + [
        (info + "/METADATA", metadata.encode("utf-8")),
        (info + "/WHEEL", wheel_txt.encode()),
        (info + "/top_level.txt", (PKG + "\n").encode()),
    ]
    filename = "%s-%s.whl" % (dist, tag)
    record = [_record_line(a, d) for a, d in entries] + [info + "/RECORD,,"]
    os.makedirs(wheel_directory, exist_ok=True)
    stamp = time.localtime(max(time.time(), 315532800))[:6]  # zip needs >= 1980
    with zipfile.ZipFile(os.path.join(wheel_directory, filename), "w",
                         zipfile.ZIP_DEFLATED) as z:
        for arcname, data in entries + [(info + "/RECORD", ("\n".join(record) + "\n").encode())]:
            zi = zipfile.ZipInfo(arcname, stamp)
            zi.external_attr = (0o755 if arcname.endswith(".so") else 0o644) << 16
            zi.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(zi, data)
    return filename


def _read(path):
    with open(path, "rb") as f:
        return f.read()


# ---------------------------------------------------------------- the C library

class NativeBuildError(RuntimeError):
    """The C library could not be built; the message says why and what to do."""


def _setting(config_settings, name, default=None):
    cs = config_settings or {}
    for key in (name, name.lower(), name.lower().replace("_", "-")):
        if key in cs:
            v = cs[key]
            return " ".join(v) if isinstance(v, list) else v
    return os.environ.get(name, default)


def _native_source():
    """The directory holding the C library's CMakeLists.txt, or None."""
    for d in (os.path.join(ROOT, "native"), os.path.dirname(ROOT)):
        if (os.path.isfile(os.path.join(d, "CMakeLists.txt")) and
                os.path.isfile(os.path.join(d, "include", "kvwire", "version.h"))):
            return d
    return None


def _log(msg):
    # pip shows a backend's output with -v, and always when the build fails.
    sys.stderr.write("kvwire_backend: %s\n" % msg)
    sys.stderr.flush()


def _run(cmd, what):
    _log("%s: %s" % (what, " ".join(cmd)))
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = p.stdout.decode("utf-8", "replace")
    if p.returncode != 0:
        tail = "\n".join(out.splitlines()[-40:])
        raise NativeBuildError("%s failed (exit %d): %s\n%s" % (what, p.returncode,
                                                                " ".join(cmd), tail))
    return out


def _build_native(config_settings):
    """Builds libkvwire.so and its modules; returns [(arcname, bytes)] for kvwire/."""
    src = _native_source()
    if src is None:
        raise NativeBuildError(
            "the kvwire C sources are not here (neither %s nor %s holds CMakeLists.txt and "
            "include/kvwire/version.h): build from the repository (pip install ./python) "
            "or from an sdist made by this backend, or copy a libkvwire.so into %s"
            % (os.path.join(ROOT, "native"), os.path.dirname(ROOT), os.path.join(ROOT, PKG)))
    cmake = shutil.which("cmake")
    if cmake is None:
        raise NativeBuildError("cmake not found: the wheel builds the C library with CMake "
                               "(scripts/install-deps.sh installs it: cmake, build-essential)")
    jobs = str(_setting(config_settings, "KVWIRE_BUILD_JOBS", "") or os.cpu_count() or 1)
    extra = (_setting(config_settings, "KVWIRE_CMAKE_ARGS", "") or "").split()
    keep = _setting(config_settings, "KVWIRE_BUILD_DIR", "")
    bdir = os.path.abspath(keep) if keep else tempfile.mkdtemp(prefix="kvwire-wheel-")
    try:
        _run([cmake, "-S", src, "-B", bdir, "-DCMAKE_BUILD_TYPE=Release",
              "-DKVW_LIBRARY_ONLY=ON"] + extra, "configure")
        _run([cmake, "--build", bdir, "-j", jobs], "build")
        lib = os.path.join(bdir, "libkvwire.so")
        if not os.path.exists(lib):
            raise NativeBuildError("the build made no %s" % lib)
        out = [(PKG + "/libkvwire.so", _read(os.path.realpath(lib)))]
        # The modules libkvwire.so loads from its own directory.
        for fn in sorted(os.listdir(bdir)):
            if (fn.startswith("libkvwire-") or fn == "libkvwire_cuda.so") and fn.endswith(".so"):
                out.append((PKG + "/" + fn, _read(os.path.join(bdir, fn))))
        _log("packaged " + ", ".join("%s (%d bytes)" % (a, len(d)) for a, d in out))
        return out
    finally:
        if not keep:
            shutil.rmtree(bdir, ignore_errors=True)


# ---------------------------------------------------------------- PEP 517 hooks

def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def get_requires_for_build_editable(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    files = _package_files()
    entries = [(a, _read(p)) for a, p in files]
    if not any(a == PKG + "/libkvwire.so" for a, _ in files):
        entries += _build_native(config_settings)
    tag, purelib = _tag(entries)
    return _write_wheel(wheel_directory, entries, tag, purelib)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    """PEP 660: a wheel holding only a .pth file that puts this directory on sys.path."""
    pth = (ROOT + "\n").encode()
    return _write_wheel(wheel_directory, [("__editable__.kvwire.pth", pth)], "py3-none-any",
                        True)


def build_sdist(sdist_directory, config_settings=None):
    name, version, metadata = _meta()
    base = "%s-%s" % (name, version)
    filename = base + ".tar.gz"
    os.makedirs(sdist_directory, exist_ok=True)
    with tarfile.open(os.path.join(sdist_directory, filename), "w:gz") as t:
        def add(arcname, data):
            ti = tarfile.TarInfo(base + "/" + arcname)
            ti.size = len(data)
            ti.mtime = int(time.time())
            ti.mode = 0o644
            t.addfile(ti, io.BytesIO(data))
        add("PKG-INFO", metadata.encode("utf-8"))
        for rel in ("pyproject.toml", "README.md", "build_backend/kvwire_backend.py"):
            if os.path.exists(os.path.join(ROOT, rel)):
                add(rel, _read(os.path.join(ROOT, rel)))
        lic = _license()
        if lic:
            add("LICENSE", _read(lic))
        # The C library's sources, which build_wheel builds from an unpacked sdist.
        src = _native_source()
        if src is not None:
            for part in NATIVE_PARTS:
                top = os.path.join(src, part)
                if os.path.isfile(top):
                    add("native/" + part, _read(top))
                    continue
                for d, dirs, fns in os.walk(top):
                    dirs.sort()
                    for fn in sorted(fns):
                        path = os.path.join(d, fn)
                        add("native/" + os.path.relpath(path, src), _read(path))
        for arcname, path in _package_files():
            if not arcname.endswith(".so"):
                add(arcname, _read(path))
        tdir = os.path.join(ROOT, "tests")
        if os.path.isdir(tdir):
            for fn in sorted(os.listdir(tdir)):
                if fn.endswith(".py"):
                    add("tests/" + fn, _read(os.path.join(tdir, fn)))
    return filename
