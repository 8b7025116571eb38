#!/usr/bin/env bash
# The official postgres image's start, for its documented variables: on an empty PGDATA, initdb
# as POSTGRES_USER with POSTGRES_PASSWORD, create POSTGRES_DB, accept password logins from any
# host (or POSTGRES_HOST_AUTH_METHOD); then run the command (postgres, listening on every
# interface). Licence: CC0-1.0.
set -euo pipefail
: "${PGDATA:=/var/lib/postgresql/data}"
user=${POSTGRES_USER:-postgres}
db=${POSTGRES_DB:-$user}
auth=${POSTGRES_HOST_AUTH_METHOD:-scram-sha-256}

if [ ! -s "$PGDATA/PG_VERSION" ]; then
  if [ -z "${POSTGRES_PASSWORD:-}" ] && [ "$auth" != trust ]; then
    echo "postgres: POSTGRES_PASSWORD is not set; set it (or POSTGRES_HOST_AUTH_METHOD=trust," \
         "which lets anyone who reaches the port in)" >&2
    exit 1
  fi
  pwfile=$(mktemp)
  printf '%s\n' "${POSTGRES_PASSWORD:-}" > "$pwfile"
  # shellcheck disable=SC2086 # POSTGRES_INITDB_ARGS is a list of flags, as in the official image
  # UTF-8 as the official image's en_US.utf8: under the C locale initdb picks SQL_ASCII, whose
  # text psycopg 3 returns as bytes (SQLAlchemy then fails on the server's version string).
  initdb -D "$PGDATA" --username="$user" --pwfile="$pwfile" --auth-local=trust \
    --auth-host="$auth" --encoding=UTF8 --locale=C.UTF-8 ${POSTGRES_INITDB_ARGS:-} >/dev/null
  rm -f "$pwfile"
  printf 'host all all all %s\n' "$auth" >> "$PGDATA/pg_hba.conf"
  if [ "$db" != postgres ]; then
    echo "CREATE DATABASE \"$db\" OWNER \"$user\";" | postgres --single -D "$PGDATA" postgres >/dev/null
  fi
  echo "postgres: initialised $PGDATA (user $user, database $db)"
fi

if [ "${1:-}" = postgres ]; then
  shift
  exec postgres -D "$PGDATA" -c listen_addresses='*' "$@"
fi
exec "$@"
