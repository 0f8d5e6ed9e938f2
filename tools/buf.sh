#!/usr/bin/env bash
# Run buf (from the npm package @bufbuild/buf) on proto/.
# buf is installed once into the project-local, git-ignored folder .tools/ (idempotent:
# nothing is downloaded when the pinned version is already there).
#   tools/buf.sh lint            # lint proto/ with proto/buf.yaml
#   tools/buf.sh <any buf args>  # run buf in proto/
set -euo pipefail
BUF_VERSION="${BUF_VERSION:-1.75.0}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PREFIX="$ROOT/.tools/buf"
BUF="$PREFIX/node_modules/.bin/buf"

installed_version() {
  [ -x "$BUF" ] && "$BUF" --version 2>/dev/null || true
}

if [ "$(installed_version)" != "$BUF_VERSION" ]; then
  command -v npm >/dev/null || { echo "tools/buf.sh: npm is required to install @bufbuild/buf" >&2; exit 2; }
  mkdir -p "$PREFIX"
  npm install --silent --no-audit --no-fund --prefix "$PREFIX" "@bufbuild/buf@$BUF_VERSION" >&2
fi

cd "$ROOT/proto"
exec "$BUF" "$@"
