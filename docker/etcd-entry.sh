#!/bin/sh
# etcd with its authentication on, as `ftrain up` runs it: only the user `root`, with a random
# password kept in /etcd-auth/password (a volume only the control plane also mounts; the file
# is owned by ftrain's image user, uid 1000, mode 0600). Arguments: etcd's own. Turns
# authentication on once; on later starts it is on already (it lives in etcd's data).
set -eu
password_file=/etcd-auth/password
if [ ! -s "$password_file" ]; then
    umask 077
    head -c 32 /dev/urandom | base64 | tr -d '/+=\n' > "$password_file.new"
    mv "$password_file.new" "$password_file"
fi
chown 1000:1000 "$password_file"
chmod 600 "$password_file"
rm -f /etcd-auth/ready
chown etcd:etcd /etcd-data

setpriv --reuid=etcd --regid=etcd --init-groups etcd "$@" &
etcd_pid=$!
trap 'kill -TERM "$etcd_pid"' TERM INT

endpoint=http://127.0.0.1:2379
until etcdctl --endpoints="$endpoint" --dial-timeout=1s endpoint status >/dev/null 2>&1; do
    kill -0 "$etcd_pid" 2>/dev/null || { wait "$etcd_pid"; exit 1; }
    sleep 0.2
done
password=$(head -n 1 "$password_file")
if etcdctl --endpoints="$endpoint" --user="root:$password" user get root >/dev/null 2>&1; then
    echo "etcd-entry: authentication is on"
else
    # (a root user may be there already, from a start that stopped before `auth enable`)
    # The password on stdin, not the command line.
    printf '%s\n' "$password" | etcdctl --endpoints="$endpoint" user add root --interactive=false \
        || printf '%s\n' "$password" | etcdctl --endpoints="$endpoint" user passwd root --interactive=false
    etcdctl --endpoints="$endpoint" user grant-role root root
    etcdctl --endpoints="$endpoint" auth enable
fi
touch /etcd-auth/ready
while kill -0 "$etcd_pid" 2>/dev/null; do wait "$etcd_pid" || true; done
