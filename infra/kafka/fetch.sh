#!/usr/bin/env bash
# Fetch the Apache Kafka broker jars from Maven Central into a local cache folder.
# Usage: infra/kafka/fetch.sh CACHE_DIR   (idempotent: a complete cache is left alone)
#
# Maven checks every jar against the checksum Maven Central publishes and fails on a
# mismatch (-C: Maven 3 only warns by default, and -q would hide the warning). The cache
# is complete when its marker names the pom it was fetched for: a changed pom (another
# log4j, another plugin) fetches again.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache="$(mkdir -p "${1:?usage: fetch.sh CACHE_DIR}" && cd "$1" && pwd)"
version="$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$here/pom.xml")"
libs="$cache/kafka-$version/libs"
pom_sum="$(sha256sum "$here/pom.xml" | cut -d' ' -f1)"
if [ -f "$libs/.complete" ] && [ "$(cat "$libs/.complete")" = "$pom_sum" ]; then
  echo "$libs"
  exit 0
fi
command -v java >/dev/null || { echo "fetch.sh: Java 17+ is required to run Kafka; install a JDK 17 (apt install openjdk-17-jre-headless)" >&2; exit 1; }
command -v mvn >/dev/null || { echo "fetch.sh: Maven (mvn) is required to fetch the Kafka jars from Maven Central; install it (apt install maven), or set LLMQ_KAFKA_BOOTSTRAP to a broker you run" >&2; exit 1; }
# Into a fresh folder, put in place only once complete: a fetch that fails (offline) leaves
# the cache that was there, which still runs the broker.
fresh="$libs.fetching"
rm -rf "$fresh"
mkdir -p "$fresh"
if ! mvn -q -B -C -f "$here/pom.xml" dependency:copy-dependencies \
    -DincludeScope=runtime -DoutputDirectory="$fresh" >&2; then
  rm -rf "$fresh"
  # (Only a complete fetch: one interrupted before this script fetched into a fresh folder
  # left a partial set, with no marker, that would fail later with missing classes.)
  if [ -f "$libs/.complete" ] && ls "$libs"/*.jar >/dev/null 2>&1; then
    echo "fetch.sh: fetching failed (above); using the jars already in $libs, fetched for an earlier pom.xml" >&2
    echo "$libs"
    exit 0
  fi
  exit 1
fi
echo "$pom_sum" > "$fresh/.complete"
rm -rf "$libs"
mv "$fresh" "$libs"
echo "$libs"
