#!/bin/sh
# Entrypoint of the training image (Dockerfile): it writes the etcd CA that AWS
# Batch passes in an environment variable to the file the etcd3 rendezvous
# reads, then runs the container's command (torchx's `bash -c "torchrun ..."`).
#
#   ELASTIC_FT_ETCD_CA_PEM  the PEM of etcd's CA (a job definition secret read from
#                           SSM); written to $ELASTIC_FT_ETCD_DIR/ca.pem, readable
#                           by this user only: give ca_cert=<that path> in --rdzv_conf.
#   ELASTIC_FT_ETCD_DIR     where (the image sets /home/eft/.etcd).
#
# The etcd password stays in its variable (password_env=ELASTIC_FT_ETCD_PASSWORD
# in --rdzv_conf): it is never written to disk or put on a command line.
set -eu

if [ "$#" -eq 0 ]; then
  echo "elastic-ft-entrypoint: no command given; e.g. torchx run -s local_cwd elastic_ft.train" >&2
  exit 2
fi

if [ -n "${ELASTIC_FT_ETCD_CA_PEM:-}" ]; then
  dir="${ELASTIC_FT_ETCD_DIR:-$HOME/.etcd}"
  (
    umask 077
    mkdir -p "$dir"
    printf '%s\n' "$ELASTIC_FT_ETCD_CA_PEM" > "$dir/ca.pem"
  )
fi

exec "$@"
