#!/usr/bin/env bash
# Run the whole test suite against a real Kafka broker.
# Uses a broker already answering on LLMQ_KAFKA_PORT (default 9092) if there is one;
# otherwise starts the embedded broker and stops it again afterwards, whatever the outcome.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bin=.venv/bin
started=0
if ! "$bin/llmq" dev kafka ping; then
  "$bin/llmq" dev kafka up || exit 1
  started=1
fi
cleanup() { if [ "$started" = 1 ]; then "$bin/llmq" dev kafka down; fi; }
trap cleanup EXIT
# Real tools the tests use when they can be built here (cached under .llmq/cache; the first
# build takes minutes, later runs seconds). A failed build only makes their tests skip.
bash infra/promtool/build.sh || echo "promtool not built: the rule-engine tests will skip"
"$bin/llmq" dev jaeger build || echo "jaeger not built: the Jaeger trace tests will skip"
"$bin/python" -m pytest "$@"
