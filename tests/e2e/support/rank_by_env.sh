#!/usr/bin/env bash
# rank_by_env.sh RANK_VARIABLE PORT_FILE CMD ARGS...: runs one rank of a job whose launcher (mpirun,
# srun) names the rank in RANK_VARIABLE and leaves the rendezvous to MASTER_ADDR/MASTER_PORT. Rank 0
# holds a port the kernel chose, writes it to PORT_FILE and hosts the store on that very socket
# (hold_port_and_exec); the other ranks wait for PORT_FILE. MASTER_ADDR is 127.0.0.1.
set -u
. "$(dirname "${BASH_SOURCE[0]}")/record.sh"
var=$1
port_file=$2
shift 2
export MASTER_ADDR=127.0.0.1
if [ "${!var}" = 0 ]; then
  hold_port_and_exec "$port_file" "$@"
else
  wait_for_file "$port_file" 60 || { echo "rank_by_env.sh: $port_file never appeared" >&2; exit 9; }
  MASTER_PORT=$(cat "$port_file") exec "$@"
fi
