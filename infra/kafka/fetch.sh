#!/usr/bin/env bash
# Fetch the Apache Kafka broker jars from Maven Central into a local cache folder.
# Usage: infra/kafka/fetch.sh CACHE_DIR   (idempotent: a complete cache is left alone)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache="$(mkdir -p "${1:?usage: fetch.sh CACHE_DIR}" && cd "$1" && pwd)"
version="$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$here/pom.xml")"
libs="$cache/kafka-$version/libs"
if [ -f "$libs/.complete" ]; then
  echo "$libs"
  exit 0
fi
command -v mvn >/dev/null || { echo "fetch.sh: Maven (mvn) is required to fetch Kafka; install it or use infra/compose.yml" >&2; exit 1; }
command -v java >/dev/null || { echo "fetch.sh: Java 17+ is required to run Kafka" >&2; exit 1; }
mkdir -p "$libs"
mvn -q -B -f "$here/pom.xml" dependency:copy-dependencies \
  -DincludeScope=runtime -DoutputDirectory="$libs" >&2
touch "$libs/.complete"
echo "$libs"
