#!/usr/bin/env bash
# System tools that `make lint-deploy` and the browser tests need and PyPI does not ship,
# from Debian:
#   promtool        (package prometheus)      alert rules, rule unit tests, metrics lint
#   docker-compose  (package docker-compose)  compose file validation, no engine needed
#   chromium        (package chromium)        the playground's browser tests (Playwright
#                                             drives it; its own browser downloads are not used)
# Idempotent: installs only what is missing. With --if-possible, a machine where
# it cannot install (not root, no apt-get) gets a warning instead of an error, so
# `make setup` still works there; lint-deploy then names what is missing.
# On a host running systemd, the prometheus package also enables a Prometheus
# service: `systemctl disable --now prometheus` if you do not want it.
set -euo pipefail

optional=false
[ "${1:-}" = "--if-possible" ] && optional=true

packages=()
command -v promtool >/dev/null 2>&1 || packages+=(prometheus)
command -v docker-compose >/dev/null 2>&1 || packages+=(docker-compose)
[ -x /usr/bin/chromium ] || packages+=(chromium)
[ "${#packages[@]}" -eq 0 ] && exit 0

fail() {
    echo "install_tools: $*" >&2
    echo "install_tools: install Debian's ${packages[*]} package(s) by hand," \
        "or run 'make setup' as root" >&2
    if "$optional"; then exit 0; fi
    exit 1
}

command -v apt-get >/dev/null 2>&1 || fail "apt-get not found (not a Debian/Ubuntu machine)"
[ "$(id -u)" -eq 0 ] || fail "not root: cannot apt-get install ${packages[*]}"

echo "install_tools: apt-get install ${packages[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null
apt-get install -y -q --no-install-recommends "${packages[@]}" >/dev/null
