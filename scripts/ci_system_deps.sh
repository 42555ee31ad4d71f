#!/usr/bin/env bash
# System (Debian/Ubuntu) packages the test suite needs beyond Python: a real single-node Slurm for
# tests/integration/test_slurm.py (slurm-wlm: slurmctld, slurmd and the sbatch/srun/squeue/scontrol clients;
# munge: its authentication daemon).
#
#   bash scripts/ci_system_deps.sh          # idempotent; a no-op (well under a second) when all are installed
#
# Needs root (or passwordless sudo) and apt-get. Without them it prints why and exits 0: the Slurm tests then
# skip with the exact reason, the rest of the suite is unaffected. Set CI_SYSTEM_DEPS_STRICT=1 to fail instead.
# Nothing is started or enabled here: the test harness starts its own munged/slurmctld/slurmd under a temp dir.
set -euo pipefail

PACKAGES=(slurm-wlm munge)
# binaries the tests call, per package that provides them
NEEDED_BINARIES=(munged munge unmunge slurmctld slurmd sbatch srun squeue scontrol sinfo scancel)
STRICT=${CI_SYSTEM_DEPS_STRICT:-0}

say() { echo "[ci_system_deps] $*"; }
give_up() {
  say "$*"
  if [ "$STRICT" = 1 ]; then exit 1; fi
  say "continuing without them: Slurm tests will be skipped with the reason"
  exit 0
}

missing_bins=()
for b in "${NEEDED_BINARIES[@]}"; do
  command -v "$b" >/dev/null 2>&1 || [ -x "/usr/sbin/$b" ] || missing_bins+=("$b")
done
if [ ${#missing_bins[@]} -eq 0 ]; then
  say "already available: ${NEEDED_BINARIES[*]} (slurm-wlm $(dpkg-query -W -f='${Version}' slurm-wlm 2>/dev/null || echo '?')); nothing to do"
  exit 0
fi
say "missing: ${missing_bins[*]}"
missing_pkgs=("${PACKAGES[@]}")

command -v apt-get >/dev/null 2>&1 || give_up "apt-get not found; install ${missing_pkgs[*]} with your package manager"
SUDO=()
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO=(sudo -n); else
    give_up "not root and no passwordless sudo; cannot install ${missing_pkgs[*]}"
  fi
fi

t0=$(date +%s)
say "installing ${missing_pkgs[*]} (apt-get update + install)"
export DEBIAN_FRONTEND=noninteractive
# policy-rc.d may forbid starting services in containers; the packages' postinst then just doesn't start them
if ! "${SUDO[@]}" apt-get update -qq >/tmp/ci_system_deps.apt.log 2>&1; then
  tail -n 20 /tmp/ci_system_deps.apt.log >&2
  give_up "apt-get update failed (log above)"
fi
if ! "${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${missing_pkgs[@]}" \
      >>/tmp/ci_system_deps.apt.log 2>&1; then
  tail -n 20 /tmp/ci_system_deps.apt.log >&2
  give_up "apt-get install ${missing_pkgs[*]} failed (log above)"
fi
still=()
for b in "${NEEDED_BINARIES[@]}"; do
  command -v "$b" >/dev/null 2>&1 || [ -x "/usr/sbin/$b" ] || still+=("$b")
done
[ ${#still[@]} -eq 0 ] || give_up "installed ${missing_pkgs[*]} but still missing: ${still[*]}"
say "installed ${missing_pkgs[*]} ($(dpkg-query -W -f='${Version}' slurm-wlm)) in $(( $(date +%s) - t0 ))s; log /tmp/ci_system_deps.apt.log"
