#!/usr/bin/env bash
# Install what fdl-fabric needs: Python packages, and with --test also the test
# tools and an OpenSSH server for the sshd lab. Idempotent and quiet when done.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
want_test=0
[ "${1:-}" = "--test" ] && want_test=1

if [ "$want_test" = 1 ]; then
  "$PY" -m pip install -q --disable-pip-version-check -r requirements-dev.txt -r requirements-torch.txt -e . 2>&1 \
    | grep -v -e "Running pip as the 'root' user" -e "is ignored: it is neither" || true
  if ! command -v sshd >/dev/null 2>&1 && [ ! -x /usr/sbin/sshd ]; then
    if [ "$(id -u)" = 0 ]; then
      echo "bootstrap: installing openssh-server (sshd is missing)"
      apt-get update -qq
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server >/dev/null
    else
      echo "bootstrap: sshd is missing; install openssh-server (the tests start real sshd hosts)" >&2
      exit 1
    fi
  fi
  if ! command -v parallel-ssh >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && [ -n "${FDL_BENCH:-}" ]; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq pssh >/dev/null || true
  fi
else
  "$PY" -m pip install -q --disable-pip-version-check -r requirements.txt -e . 2>&1 \
    | grep -v -e "Running pip as the 'root' user" -e "is ignored: it is neither" || true
fi
# Bytecode for the package: every launch imports it, and with PYTHONDONTWRITEBYTECODE
# set (as on these machines) Python would compile it from source at every start.
"$PY" -m compileall -q fdl_fabric >/dev/null
