#!/usr/bin/env bash
# The coding agents the agent tests (tests/agents/) drive against `flashserve serve`,
# from npm at the versions pinned in tests/agents/npm/package.json (+ its lock):
#   opencode  (npm opencode-ai)                OpenAI-compatible provider at /v1
#   claude    (npm @anthropic-ai/claude-code)  Messages API at /anthropic
# into .agents/ (gitignored), binaries at .agents/node_modules/.bin/.
# Idempotent and quick: a stamp holds the hash of the pinned manifest and lock, so a
# second run with nothing changed only checks that both binaries still start.
# With --if-possible, a machine without node/npm (or without the npm registry) gets a
# warning instead of an error, so `make setup` still works there; the agent tests
# then skip with a notice.
set -euo pipefail

optional=false
[ "${1:-}" = "--if-possible" ] && optional=true

root="$(cd "$(dirname "$0")/.." && pwd)"
spec="$root/tests/agents/npm"
dest="${FLASHSERVE_AGENTS_DIR:-$root/.agents}"
stamp="$dest/.installed"

fail() {
    echo "install_agents: $*" >&2
    echo "install_agents: the coding-agent tests (tests/agents/) will be skipped" >&2
    if "$optional"; then exit 0; fi
    exit 1
}

command -v node >/dev/null 2>&1 || fail "node not found (install Node.js 20+ and npm)"
command -v npm >/dev/null 2>&1 || fail "npm not found (install npm)"

want="$(cat "$spec/package.json" "$spec/package-lock.json" | sha256sum | cut -d' ' -f1)"
bins_work() {
    "$dest/node_modules/.bin/opencode" --version >/dev/null 2>&1 &&
        "$dest/node_modules/.bin/claude" --version >/dev/null 2>&1
}
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && bins_work; then
    exit 0
fi

echo "install_agents: npm install opencode-ai and @anthropic-ai/claude-code into $dest"
mkdir -p "$dest"
rm -f "$stamp"
cp "$spec/package.json" "$spec/package-lock.json" "$dest/"
# `npm install`, not `npm ci`: the lock records only the platform packages the
# registry it was made from serves, and `npm ci` refuses a lock that lacks any of
# the optional ones. Install scripts off: npm 11 blocks unapproved ones anyway, and
# both packages' postinstall only copies the native binary of this platform (the
# optional dependency npm just installed, e.g. opencode-linux-x64) over a stub, so
# they are run by name below, where their failure is ours to report.
(cd "$dest" && npm install --no-audit --no-fund --ignore-scripts --loglevel=error) ||
    fail "npm install failed (no network or no npm registry?)"
(cd "$dest/node_modules/opencode-ai" && node ./postinstall.mjs) ||
    fail "opencode-ai: no native binary for $(uname -sm)"
(cd "$dest/node_modules/@anthropic-ai/claude-code" && node ./install.cjs) ||
    fail "@anthropic-ai/claude-code: no native binary for $(uname -sm)"
bins_work || fail "an installed agent does not start (try: $dest/node_modules/.bin/opencode --version)"
echo "$want" >"$stamp"
echo "install_agents: opencode $("$dest/node_modules/.bin/opencode" --version)," \
    "claude $("$dest/node_modules/.bin/claude" --version)"
