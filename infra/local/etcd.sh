#!/usr/bin/env bash
# A local etcd v3 member for development (Debian package etcd-server), the
# rendezvous store of `torchrun --rdzv-backend=etcd3` and of
# `torchx run ... elastic_ft.train --rdzv_backend etcd3`.
#
#   infra/local/etcd.sh start    # prints the endpoint, e.g. 127.0.0.1:2379
#   infra/local/etcd.sh status
#   infra/local/etcd.sh stop     # keeps the data dir; `wipe` removes it
#
# Settings (environment): ETCD_PORT (client port, default 2379), ETCD_PEER_PORT
# (default ETCD_PORT+1), ETCD_DIR (data, pid and log; default .etcd-local in the
# repository). It listens on 127.0.0.1 only.
set -euo pipefail

repo="$(cd "$(dirname "$0")/../.." && pwd)"
port="${ETCD_PORT:-2379}"
peer_port="${ETCD_PEER_PORT:-$((port + 1))}"
dir="${ETCD_DIR:-$repo/.etcd-local}"
pidfile="$dir/etcd.pid"
logfile="$dir/etcd.log"
endpoint="127.0.0.1:$port"

running() {
  [[ -f "$pidfile" ]] && kill -0 "$(cat "$pidfile")" 2>/dev/null
}

healthy() {
  ETCDCTL_API=3 etcdctl --endpoints="http://$endpoint" --dial-timeout=1s endpoint health >/dev/null 2>&1
}

case "${1:-}" in
  start)
    if ! command -v etcd >/dev/null; then
      echo "etcd is not installed: run 'sudo apt-get install etcd-server' (Debian/Ubuntu) and retry." >&2
      exit 1
    fi
    if running; then
      echo "$endpoint"
      exit 0
    fi
    mkdir -p "$dir"
    nohup etcd --name local --data-dir "$dir/data" \
      --listen-client-urls "http://$endpoint" --advertise-client-urls "http://$endpoint" \
      --listen-peer-urls "http://127.0.0.1:$peer_port" \
      --initial-advertise-peer-urls "http://127.0.0.1:$peer_port" \
      --initial-cluster "local=http://127.0.0.1:$peer_port" \
      --logger zap --log-level warn >>"$logfile" 2>&1 &
    echo $! >"$pidfile"
    # Wait (bounded) until it serves requests, so the caller can use it at once.
    for _ in $(seq 1 100); do
      if healthy; then
        echo "$endpoint"
        exit 0
      fi
      if ! running; then break; fi
      sleep 0.1
    done
    echo "etcd did not become healthy on $endpoint; see $logfile (is the port taken? set ETCD_PORT)." >&2
    exit 1
    ;;
  stop)
    if running; then
      kill "$(cat "$pidfile")"
      for _ in $(seq 1 100); do running || break; sleep 0.1; done
    fi
    rm -f "$pidfile"
    echo "etcd on $endpoint stopped (data kept in $dir/data)."
    ;;
  status)
    if running && healthy; then
      echo "running: $endpoint (pid $(cat "$pidfile"), data $dir/data)"
    else
      echo "not running ($endpoint)"
      exit 3
    fi
    ;;
  wipe)
    "$0" stop >/dev/null
    rm -rf "$dir"
    echo "removed $dir"
    ;;
  *)
    echo "usage: $0 start|stop|status|wipe" >&2
    exit 2
    ;;
esac
