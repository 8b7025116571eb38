#!/usr/bin/env bash
# Install a headless Chromium from Debian, so the browser tests (tests/support/browser.py: the
# gateway's cross-site refusals, a dashboard) drive a real browser. Idempotent: a quick no-op when
# it is there. The tests start it themselves (headless, no sandbox, their own profile).
set -euo pipefail

have() {
  command -v chromium >/dev/null 2>&1 || [ -x /usr/bin/chromium ]
}

if have; then
  exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
  SUDO=
elif command -v sudo >/dev/null 2>&1; then
  SUDO="sudo -n"  # never stop to ask for a password (make test runs this)
else
  echo "Chromium is not installed and installing it needs root" >&2
  exit 1
fi

$SUDO apt-get update -qq
$SUDO env DEBIAN_FRONTEND=noninteractive \
  apt-get install -y -qq --no-install-recommends chromium >/dev/null
have
echo "chromium installed: $(dpkg-query -W -f='${Version}' chromium)"
