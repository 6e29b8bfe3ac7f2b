#!/bin/sh
# Container entry point: `flashserve serve` configured by environment and flags.
#   FLASHSERVE_MODEL   "tiny" or a checkpoint directory      (default tiny)
#   FLASHSERVE_HOST    listen address                         (default 0.0.0.0)
#   FLASHSERVE_PORT    listen port; the HEALTHCHECK reads it  (default 8000)
#   FLASHSERVE_KV_DIR  SSD tier directory, a volume           (default /var/lib/flashserve/kv)
# Arguments starting with "-" are appended as further `serve` flags
# (docker run IMAGE --max-num-seqs 8); any other command runs as given
# (docker run IMAGE flashserve inspect --model tiny).
set -eu

if [ "$#" -gt 0 ] && [ "${1#-}" = "$1" ]; then
    exec "$@"
fi

exec flashserve serve \
    --model "${FLASHSERVE_MODEL:-tiny}" \
    --host "${FLASHSERVE_HOST:-0.0.0.0}" \
    --port "${FLASHSERVE_PORT:-8000}" \
    --kv-dir "${FLASHSERVE_KV_DIR:-/var/lib/flashserve/kv}" \
    "$@"
