#!/usr/bin/env python3
"""Generate the protobuf/gRPC Python code and type stubs from ``proto/``.

Usage::

    python tools/genproto.py          # (re)write scheduler_service/gen/
    python tools/genproto.py --check  # exit 1 when scheduler_service/gen/ is stale

The generated code lives in exactly one place, ``scheduler_service/gen/``, and is never
edited by hand.  protoc emits absolute imports (``from slidingserve.v1 import ...``) that
only work with the output folder on ``sys.path``; we rewrite them to
``scheduler_service.gen.slidingserve.v1`` so that the code is an ordinary subpackage.
``--check`` regenerates into a temporary folder and compares byte for byte, so CI fails
whenever someone edits the .proto without regenerating (or edits generated files).
"""

from __future__ import annotations

import argparse
import filecmp
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
GEN = ROOT / "scheduler_service" / "gen"
GEN_PKG = "scheduler_service.gen"
#: Top-level proto packages whose imports we rewrite.
PROTO_PACKAGES = ("slidingserve",)

INIT_DOC = '"""Generated from proto/ by tools/genproto.py. Do not edit."""\n'


def _protos() -> list[Path]:
    return sorted(p.relative_to(PROTO_ROOT) for p in PROTO_ROOT.rglob("*.proto"))


def _plugin(name: str) -> str:
    exe = Path(sys.executable).parent / name
    found = str(exe) if exe.exists() else shutil.which(name)
    if not found:
        raise SystemExit(f"genproto: {name} not found (install the dev extra: pip install -e '.[dev]')")
    return found


def _rewrite_imports(text: str) -> str:
    pkgs = "|".join(PROTO_PACKAGES)
    text = re.sub(rf"^from ({pkgs})((?:\.\w+)*) import ", rf"from {GEN_PKG}.\1\2 import ", text, flags=re.M)
    text = re.sub(rf"^import ({pkgs})((?:\.\w+)+)", rf"import {GEN_PKG}.\1\2", text, flags=re.M)
    # Type references inside .pyi stubs (``slidingserve.v1.scheduler_pb2.Foo``).
    text = re.sub(rf"(?<![\w.])({pkgs})\.(\w+)\.(\w+_pb2)\b", rf"{GEN_PKG}.\1.\2.\3", text)
    return text


def generate(out: Path) -> None:
    """Run protoc (grpc_tools) into ``out`` and post-process the result."""
    # Deferred: grpcio-tools is a development-only dependency; the module's text helpers
    # import without it.
    import grpc_tools
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
        f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        "--mypy_opt=quiet",
        "--mypy_grpc_opt=quiet",
        f"--mypy_out={out}",
        f"--mypy_grpc_out={out}",
        *[str(p) for p in _protos()],
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise SystemExit(f"genproto: protoc failed with exit code {rc}")
    for path in out.rglob("*"):
        if path.suffix in (".py", ".pyi"):
            path.write_text(_rewrite_imports(path.read_text()))
    # Every folder is a regular package.
    for d in [out, *(p for p in out.rglob("*") if p.is_dir())]:
        (d / "__init__.py").write_text(INIT_DOC)
    (out / "py.typed").write_text("")


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def _generator_hint() -> str:
    """Name the generators when they are not the ones pyproject.toml pins (their versions are
    stamped into the code, so a new release alone makes the check fail)."""
    from importlib.metadata import PackageNotFoundError, version

    pins = re.findall(r'"(grpcio-tools|mypy-protobuf)==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    off = []
    for name, want in pins:
        try:
            have = version(name)
        except PackageNotFoundError:
            have = "missing"
        if have != want:
            off.append(f"{name} {have}, pinned {want}")
    return f" -- or install the pinned generators first ({'; '.join(off)})" if off else ""


def check() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp) / "gen"
        generate(fresh)
        want, have = _files(fresh), _files(GEN) if GEN.exists() else set()
        stale = sorted(
            [f"{f} (missing)" for f in want - have]
            + [f"{f} (extra)" for f in have - want]
            + [f for f in want & have if not filecmp.cmp(fresh / f, GEN / f, shallow=False)]
        )
    if stale:
        print(
            f"genproto: scheduler_service/gen is stale ({', '.join(stale)}); run: python tools/genproto.py"
            f"{_generator_hint()}",
            file=sys.stderr,
        )
        return 1
    print("genproto: scheduler_service/gen is up to date")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail when the generated code is stale")
    ns = ap.parse_args(argv)
    if ns.check:
        return check()
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp) / "gen"
        generate(fresh)
        if GEN.exists():
            shutil.rmtree(GEN)
        shutil.copytree(fresh, GEN)
    print(f"genproto: wrote {len(_files(GEN))} files to {GEN.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
