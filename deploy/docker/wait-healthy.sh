#!/usr/bin/env bash
# Waits until every container of the lab's Compose project runs and reports
# healthy (the healthchecks of compose.yaml), then says how long it took.
# Works with docker-compose v1 (Debian's 1.29, which has no `up --wait`) and
# with Compose v2 (`docker compose`).
#
#   deploy/docker/wait-healthy.sh [-p PROJECT] [--timeout SECS]
#
#   -p PROJECT      the Compose project [default: $LAB_PROJECT or lab]
#   --timeout SECS  give up after this long, listing what is not healthy,
#                   with exit status 1 [default: 300]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

project="${LAB_PROJECT:-lab}"
timeout=300
while [ $# -gt 0 ]; do
  case "$1" in
    -p|--project) project="$2"; shift 2 ;;
    --timeout) timeout="$2"; shift 2 ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "wait-healthy: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
if command -v docker-compose >/dev/null; then
  compose=(docker-compose)
elif docker compose version >/dev/null 2>&1; then
  compose=(docker compose)
else
  echo "wait-healthy: neither docker-compose nor docker compose is installed" >&2
  exit 1
fi

start=$SECONDS
while :; do
  # `ps -a`: v2 lists only running containers without it; v1 lists all anyway
  # and has no -a (it would mean something else), hence the two forms.
  if [ "${compose[0]}" = docker-compose ]; then
    ids="$("${compose[@]}" -f "$here/compose.yaml" -p "$project" ps -q)"
  else
    ids="$("${compose[@]}" -f "$here/compose.yaml" -p "$project" ps -a -q)"
  fi
  if [ -z "$ids" ]; then
    echo "wait-healthy: project $project has no containers (start it with up -d first)" >&2
    exit 1
  fi
  # One line per container that is not both running and healthy.
  # shellcheck disable=SC2086
  pending="$(docker inspect -f '{{.Name}} {{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{else}}no-healthcheck{{end}}' $ids \
    | awk '!($2 == "running" && $3 == "healthy") {sub(/^\//, "", $1); print "  " $0}')"
  if [ -z "$pending" ]; then
    echo "project $project: all $(wc -w <<<"$ids") containers running and healthy (waited $((SECONDS - start)) s)"
    exit 0
  fi
  if [ $((SECONDS - start)) -ge "$timeout" ]; then
    echo "wait-healthy: not healthy after ${timeout} s (name, state, health):" >&2
    echo "$pending" >&2
    echo "(docker inspect --format '{{json .State.Health}}' NAME shows the last checks' output)" >&2
    exit 1
  fi
  sleep 2
done
