#!/usr/bin/env bash
# Install what fdl-fabric needs: Python packages, and with --test also the test
# tools (py-spy through the [stacks] extra), an OpenSSH server (the sshd lab), Slurm
# and munge (the Slurm lab), and tmux (a real terminal with job control).
# Idempotent and quiet when done.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
want_test=0
[ "${1:-}" = "--test" ] && want_test=1

if [ "$want_test" = 1 ]; then
  "$PY" -m pip install -q --disable-pip-version-check -r requirements-dev.txt -r requirements-torch.txt -e ".[stacks,plot]" 2>&1 \
    | grep -v -e "Running pip as the 'root' user" -e "is ignored: it is neither" || true
  # Debian packages the labs need: sshd (the sshd lab), Slurm's daemons and clients and
  # munge (the Slurm lab). Installed only when missing, and only as root.
  missing=()
  { command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ]; } || missing+=(openssh-server)
  { command -v slurmctld >/dev/null 2>&1 || [ -x /usr/sbin/slurmctld ]; } \
    && command -v srun >/dev/null 2>&1 || missing+=(slurm-wlm)
  { command -v munged >/dev/null 2>&1 || [ -x /usr/sbin/munged ]; } || missing+=(munge)
  command -v tmux >/dev/null 2>&1 || missing+=(tmux)
  command -v zsh >/dev/null 2>&1 || missing+=(zsh)  # the zsh completion test
  command -v git >/dev/null 2>&1 || missing+=(git)  # sync: work trees and code ids
  command -v ss >/dev/null 2>&1 || missing+=(iproute2)  # sync: bytes sent, per socket
  { command -v nft >/dev/null 2>&1 || [ -x /usr/sbin/nft ]; } || missing+=(nftables)  # the fleet lab
  [ -x /usr/bin/python3 ] || missing+=(python3)  # another user's processes (not under /root)
  if [ "${#missing[@]}" -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then
      echo "bootstrap: installing ${missing[*]} (apt-get)"
      apt-get update -qq
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${missing[@]}" >/dev/null
    else
      echo "bootstrap: missing ${missing[*]}; install them (the tests start real sshd" \
        "hosts and a real Slurm cluster)" >&2
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
