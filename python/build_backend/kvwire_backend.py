"""A PEP 517 build backend for the kvwire Python package, standard library only.

The package is pure Python (ctypes over libkvwire.so), so building it needs nothing
but zipfile and tarfile. Building with setuptools would need setuptools and, for
setuptools < 70.1, the separate `wheel` package inside pip's isolated build
environment: both would have to be downloaded, which fails on offline machines. With
this backend `pip install ./python` (and `pip install -e ./python`) works with no
network and no build dependencies.

Metadata comes from the [project] table of pyproject.toml (name, version,
description, requires-python) and README.md. A libkvwire.so (or other *.so) copied
into kvwire/ before building is shipped inside the wheel, which is then tagged for
this platform instead of py3-none-any.
"""
import base64
import hashlib
import io
import os
import re
import sysconfig
import tarfile
import time
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = "kvwire"


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
    return out


def _meta():
    p = _project()
    name, version = p["name"], p["version"]
    lines = ["Metadata-Version: 2.1", "Name: " + name, "Version: " + version]
    if p.get("description"):
        lines.append("Summary: " + p["description"])
    if p.get("requires-python"):
        lines.append("Requires-Python: " + p["requires-python"])
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
    entries = list(entries) + [
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


# ---------------------------------------------------------------- PEP 517 hooks

def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def get_requires_for_build_editable(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    files = _package_files()
    tag, purelib = _tag(files)
    return _write_wheel(wheel_directory, [(a, _read(p)) for a, p in files], tag, purelib)


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
        for arcname, path in _package_files():
            if not arcname.endswith(".so"):
                add(arcname, _read(path))
        tdir = os.path.join(ROOT, "tests")
        if os.path.isdir(tdir):
            for fn in sorted(os.listdir(tdir)):
                if fn.endswith(".py"):
                    add("tests/" + fn, _read(os.path.join(tdir, fn)))
    return filename
