#!/usr/bin/env bash
# Build Prometheus's `promtool` from source through the Go module proxy, so that the alert
# rules in infra/prometheus/ are checked by the real rule engine (`promtool check rules`,
# `promtool test rules`) rather than only by our own parser.
#
# Usage: infra/promtool/build.sh [CACHE_DIR]
#   default CACHE_DIR: ${LLMQ_HOME:-<repo>/.llmq}/cache/promtool, where
#   tests/unit/test_obs_rules.py looks for it (Settings().cache_dir / "promtool").
#
# Idempotent: if CACHE_DIR/promtool exists and was built from the version pinned in
# infra/promtool/go.mod, it does nothing. The pinned version lives in go.mod/go.sum (its own
# module, so Prometheus's large dependency tree never touches another module). Without Go or
# without network access it exits 1 and the promtool tests skip with the reason.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
cache="${1:-${LLMQ_HOME:-$root/.llmq}/cache/promtool}"
mkdir -p "$cache"
bin="$cache/promtool"
stamp="$cache/built-from"

cd "$here"
# The version is whatever go.mod requires for github.com/prometheus/prometheus (read from
# the file, so checking needs neither the network nor the module cache).
want="$(awk '$1 == "github.com/prometheus/prometheus" { print $2 }' go.mod)"
if [ -z "$want" ]; then
  echo "build.sh: no github.com/prometheus/prometheus requirement in $here/go.mod" >&2
  exit 1
fi
if [ -x "$bin" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "promtool $want already built at $bin"
  exit 0
fi
if ! command -v go >/dev/null 2>&1; then
  echo "build.sh: go is not on PATH; cannot build promtool" >&2
  exit 1
fi
echo "building promtool $want into $bin (several minutes on a small machine) ..."
# Build to a temporary name and rename, so an interrupted build never leaves a half binary
# that the next run would trust. The version is stamped in (`promtool --version`), as
# Prometheus's own release build does.
go build -trimpath \
  -ldflags "-X github.com/prometheus/common/version.Version=$want" \
  -o "$bin.tmp" github.com/prometheus/prometheus/cmd/promtool
mv -f "$bin.tmp" "$bin"
echo "$want" > "$stamp"
"$bin" --version | head -1
