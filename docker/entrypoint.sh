#!/bin/sh
# Container entry point: `flashserve serve` configured by environment and flags.
#   FLASHSERVE_ROLE         unset: one colocated server (serve's default role, "both");
#                           both, prefill, decode or router: passed as --role
#   FLASHSERVE_MODEL        "tiny" or a checkpoint directory      (default tiny; not for a router)
#   FLASHSERVE_HOST         listen address                         (default 0.0.0.0)
#   FLASHSERVE_PORT         listen port; the HEALTHCHECK reads it  (default 8000)
#   FLASHSERVE_KV_DIR       SSD tier directory, a volume           (default /var/lib/flashserve/kv;
#                           not for a router). Prefill and decode workers hand pages over
#                           through it: every worker of one deployment mounts the SAME volume.
#   FLASHSERVE_PREFILL_URL  router only: prefill worker URLs, separated by commas or spaces
#   FLASHSERVE_DECODE_URL   router only: decode worker URLs, likewise (one of each at least)
# A router gets --role router, its --prefill-url/--decode-url flags, --host and --port,
# and no --model or --kv-dir (it loads no model).
# Arguments starting with "-" are appended as further `serve` flags
# (docker run IMAGE --max-num-seqs 8); any other command runs as given
# (docker run IMAGE flashserve inspect tiny).
set -eu

if [ "$#" -gt 0 ] && [ "${1#-}" = "$1" ]; then
    exec "$@"
fi

role=${FLASHSERVE_ROLE:-}
case "$role" in
    "" | both | prefill | decode | router) ;;
    *)
        echo "flashserve-entrypoint: FLASHSERVE_ROLE=$role: expected both, prefill, decode" \
            "or router" >&2
        exit 64
        ;;
esac

# Our flags are appended after the caller's, which are then moved behind them
# (a later flag wins, so the caller's override ours).
extra=$#
if [ -n "$role" ]; then
    set -- "$@" --role "$role"
fi
if [ "$role" = router ]; then
    set -f # URLs are split on commas and blanks, never globbed
    old_ifs=$IFS
    IFS=$(printf ', \t')
    for url in ${FLASHSERVE_PREFILL_URL:-}; do
        set -- "$@" --prefill-url "$url"
    done
    for url in ${FLASHSERVE_DECODE_URL:-}; do
        set -- "$@" --decode-url "$url"
    done
    IFS=$old_ifs
    set +f
else
    set -- "$@" --model "${FLASHSERVE_MODEL:-tiny}"
fi
set -- "$@" --host "${FLASHSERVE_HOST:-0.0.0.0}" --port "${FLASHSERVE_PORT:-8000}"
if [ "$role" != router ]; then
    set -- "$@" --kv-dir "${FLASHSERVE_KV_DIR:-/var/lib/flashserve/kv}"
fi
while [ "$extra" -gt 0 ]; do
    set -- "$@" "$1"
    shift
    extra=$((extra - 1))
done

exec flashserve serve "$@"
