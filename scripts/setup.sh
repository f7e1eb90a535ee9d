#!/usr/bin/env bash
# One-time (idempotent) set-up on a fresh machine: a virtual environment in
# .venv with elastic_ft and its dependencies, torch held at the provisioned
# CPU build by constraints.txt. With --test, also the test extras (and the
# optional plot, tensorboard and qlora extras, which the tests exercise), and the
# Debian etcd server and etcdctl (the rendezvous tests start a server on
# 127.0.0.1 and enable auth on it with etcdctl).
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
if [[ "${1:-}" == "--test" ]]; then extras="[test,plot,tensorboard,qlora]"; fi

if [[ ! -x .venv/bin/python ]]; then
  python3 -m venv .venv
fi
stamp=".venv/.installed${extras}"
if [[ ! -f "$stamp" || pyproject.toml -nt "$stamp" || setup.py -nt "$stamp" || constraints.txt -nt "$stamp" ]]; then
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  .venv/bin/python -m pip install -q -c constraints.txt -e ".${extras}"
  touch "$stamp"
fi

if [[ -n "$extras" ]] && ! { command -v etcd && command -v etcdctl; } >/dev/null 2>&1; then
  if [[ $(id -u) -eq 0 ]]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server etcd-client >/dev/null
  else
    echo "etcd is not installed: run 'sudo apt-get install etcd-server etcd-client' (Debian) and retry" >&2
    exit 1
  fi
fi
