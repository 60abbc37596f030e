#!/bin/sh
# hora's container entrypoint.
#
#   hora-entrypoint worker        run sshd in the foreground (a worker the launcher reaches by SSH)
#   hora-entrypoint health        the health check: worker mode -> sshd accepts connections
#   hora-entrypoint CMD ARGS...   set up the SSH client, then exec CMD (e.g. hora run ...)
#
# SSH keys are never part of the image: they come from a mounted secret directory
# ($HORA_SSH_SECRET_DIR, default /etc/hora/ssh) holding a private key `id_ed25519` (or `id_rsa`) and
# optionally `authorized_keys` (default: the private key's own public half). They are copied into
# the user's ~/.ssh with mode 0600, because secret mounts often carry modes that ssh refuses.
# Host keys are generated at start, so two containers of one image never share them.
set -eu

SECRET_DIR="${HORA_SSH_SECRET_DIR:-/etc/hora/ssh}"
PORT="${HORA_SSH_PORT:-2222}"
STATE="${HORA_SSH_STATE_DIR:-$HOME/.hora-ssh}"
STRICT="${HORA_SSHD_STRICT_MODES:-yes}"

say() { echo "hora-entrypoint: $*" >&2; }

find_key() {
    for name in id_ed25519 id_ecdsa id_rsa ssh-privatekey; do
        if [ -f "$SECRET_DIR/$name" ]; then echo "$SECRET_DIR/$name"; return 0; fi
    done
    return 1
}

# Copy the key from the secret (the client side: the launcher and any rank that starts ssh).
setup_client() {
    mkdir -p "$STATE" && chmod 700 "$STATE"
    if key=$(find_key); then
        if ! cat "$key" > "$STATE/id_key" 2>/dev/null; then
            say "cannot read the SSH key $key as $(id -un) (uid $(id -u)); mount the secret readable by this user"
            exit 1
        fi
        chmod 600 "$STATE/id_key"
        if [ -z "${HORA_SSH_COMMAND:-}" ]; then
            HORA_SSH_COMMAND="ssh -p $PORT -i $STATE/id_key"
            export HORA_SSH_COMMAND
        fi
        return 0
    fi
    return 1
}

setup_server() {
    if ! setup_client; then
        say "no SSH key in $SECRET_DIR (expected id_ed25519, id_ecdsa, id_rsa or ssh-privatekey); a worker needs one to accept the launcher"
        exit 1
    fi
    if [ -f "$SECRET_DIR/authorized_keys" ]; then
        cat "$SECRET_DIR/authorized_keys" > "$STATE/authorized_keys"
    else
        ssh-keygen -y -f "$STATE/id_key" > "$STATE/authorized_keys"
    fi
    chmod 600 "$STATE/authorized_keys"
    rm -f "$STATE/host_key" "$STATE/host_key.pub"
    ssh-keygen -q -t ed25519 -N "" -C "hora-worker-host-key" -f "$STATE/host_key"
    cat > "$STATE/sshd_config" <<CONFIG
Port $PORT
HostKey $STATE/host_key
AuthorizedKeysFile $STATE/authorized_keys
PidFile none
StrictModes $STRICT
UsePAM no
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
X11Forwarding no
PrintMotd no
UseDNS no
MaxStartups 100
MaxSessions 100
SetEnv PATH=$PATH
LogLevel ${HORA_SSHD_LOG_LEVEL:-ERROR}
CONFIG
    echo "$PORT" > "$STATE/worker-port"
}

case "${1:-}" in
    worker)
        setup_server
        mkdir -p /run/sshd 2>/dev/null || true
        say "worker: sshd on port $PORT as $(id -un)"
        exec /usr/sbin/sshd -D -e -f "$STATE/sshd_config"
        ;;
    health)
        if [ -f "$STATE/worker-port" ]; then
            exec python3 -c "import socket,sys; socket.create_connection(('127.0.0.1', int(sys.argv[1])), 3).close()" "$(cat "$STATE/worker-port")"
        fi
        exec python3 -c "import hora"
        ;;
    "")
        say "usage: hora-entrypoint worker | health | COMMAND [ARGS...]"
        exit 2
        ;;
    *)
        setup_client || true
        # The launcher of a fixed-size job: wait until every worker accepts connections on its SSH
        # port ($HORA_WAIT_FOR_HOSTS: host:slots,...), naming the ones still missing, within a bound.
        if [ -n "${HORA_WAIT_FOR_HOSTS:-}" ]; then
            python3 - "$HORA_WAIT_FOR_HOSTS" "$PORT" "${HORA_WAIT_FOR_WORKERS_SECONDS:-600}" <<'PY'
import socket, sys, time
hosts = [entry.rsplit(":", 1)[0] for entry in sys.argv[1].split(",") if entry]
port, limit = int(sys.argv[2]), float(sys.argv[3])
deadline, last_report, missing = time.monotonic() + limit, 0.0, hosts
while True:
    still = []
    for host in missing:
        try:
            socket.create_connection((host, port), 3).close()
        except OSError as exc:
            still.append(f"{host} ({exc})")
    if not still:
        break
    missing = [entry.split(" (", 1)[0] for entry in still]
    if time.monotonic() > deadline:
        sys.exit(f"hora-entrypoint: workers not reachable on port {port} after {limit:g} s: {', '.join(still)}")
    if time.monotonic() - last_report > 10:
        print(f"hora-entrypoint: waiting for {len(still)} worker(s): {', '.join(still)}", file=sys.stderr, flush=True)
        last_report = time.monotonic()
    time.sleep(1)
PY
        fi
        exec "$@"
        ;;
esac
