#!/usr/bin/env bash
# Installs the .deb packaging/build.sh made on this machine (as root), checks what an
# operator would see, runs the unit's commands as written against the installed files,
# then purges the package and checks that nothing is left. Checks the .rpm's file list and
# scripts with `rpm -qp`. CI runs it (.ci/run); it changes the machine it runs on.
set -euo pipefail
cd "$(dirname "$0")/.."

target_dir="${CARGO_TARGET_DIR:-target}"
deb="$(ls -t "$target_dir"/debian/moe-node_*.deb | head -n 1)"
rpm_file="$(ls -t "$target_dir"/generate-rpm/moe-node-*.rpm | head -n 1)"
fail() {
    echo "package test: $*" >&2
    exit 1
}
expect_mode() { # path owner:group mode
    local got
    got="$(stat -c '%U:%G %a' "$1")"
    [ "$got" = "$2 $3" ] || fail "$1 is $got, expected $2 $3"
}

echo "--- installing $deb"
dpkg -i "$deb"
[ -x /usr/bin/moe-node ] || fail "no /usr/bin/moe-node"
getent passwd moe-node >/dev/null || fail "no moe-node user"
expect_mode /etc/moe-node/moe-node.toml root:moe-node 640
expect_mode /etc/moe-node/credentials/api_keys root:root 600
expect_mode /etc/moe-node/credentials/control_plane_token root:root 600
expect_mode /etc/moe-node/credentials/cluster_secrets root:root 600
# A cluster secret made on install (128 random bits, hex), once: configuring again adds none.
secret_lines() { grep -c '^[^#[:space:]]' /etc/moe-node/credentials/cluster_secrets || true; }
grep -Eqx '[0-9a-f]{32}' /etc/moe-node/credentials/cluster_secrets ||
    fail "no generated secret in /etc/moe-node/credentials/cluster_secrets"
/var/lib/dpkg/info/moe-node.postinst configure >/dev/null
[ "$(secret_lines)" = 1 ] || fail "configuring again changed the generated secret"
unit=/lib/systemd/system/moe-node.service
[ -f "$unit" ] || unit=/usr/lib/systemd/system/moe-node.service
[ -f "$unit" ] || fail "no moe-node.service"
# Enabled (starts at boot) but not started: it is configured first.
[ -L /etc/systemd/system/multi-user.target.wants/moe-node.service ] || fail "the unit is not enabled"
gateway_unit="$(dirname "$unit")/moe-node-gateway.service"
[ -f "$gateway_unit" ] || fail "no moe-node-gateway.service"
# Installed, not enabled: a gateway is set up where one is wanted.
[ ! -e /etc/systemd/system/multi-user.target.wants/moe-node-gateway.service ] ||
    fail "the gateway unit is enabled"
zcat /usr/share/man/man1/moe-node.1.gz | grep -q '^\.TH moe-node' || fail "no manual page"
grep -q moe-node /usr/share/bash-completion/completions/moe-node || fail "no bash completion"
[ -f /usr/share/doc/moe-node/examples/local-cluster/node1.toml ] || fail "no example configs"
[ -f /usr/share/doc/moe-node/README.md ] || fail "no README"
[ -f /usr/share/doc/moe-node/docs/configuration.md ] || fail "no docs/ pages"
[ -f /usr/share/moe-node/grafana/moe-node.json ] || fail "no Grafana dashboard"
[ -f /usr/share/moe-node/prometheus/moe-node-alerts.yml ] || fail "no Prometheus alerts"

echo "--- systemd-analyze verify"
systemd-analyze verify "$unit" "$gateway_unit"
systemd-analyze security --offline=true "$unit" | tail -n 1
systemd-analyze security --offline=true "$gateway_unit" | tail -n 1

echo "--- the unit's commands, as written, as its user"
exec_line() { sed -n "s/^$1=//p" "$unit"; }
mkdir -p /var/cache/moe-node /var/lib/moe-node
chown moe-node:moe-node /var/cache/moe-node /var/lib/moe-node
credentials="$(mktemp -d)"
cp /etc/moe-node/credentials/* "$credentials/"
echo "package-test-key" >>"$credentials/api_keys"
chmod -R a+rX "$credentials"
# setpriv and env exec, so the node is the process signalled (runuser would stay its parent).
as_service=(setpriv --reuid moe-node --regid moe-node --init-groups
    env XDG_CACHE_HOME=/var/cache CREDENTIALS_DIRECTORY="$credentials")
# shellcheck disable=SC2046 # the unit's command line, split as systemd splits it
# (`moe-node check`: with the generated cluster secret among the credentials, it must pass.)
"${as_service[@]}" $(exec_line ExecStartPre)
base=http://127.0.0.1:8080
if curl -s -o /dev/null "$base/health"; then fail "something already listens on $base"; fi
log="$(mktemp)"
# shellcheck disable=SC2046
"${as_service[@]}" $(exec_line ExecStart) >"$log" 2>&1 &
server=$!
trap 'kill -KILL "$server" 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do
    if curl -fsS "$base/ready" >/dev/null 2>&1; then break; fi
    kill -0 "$server" 2>/dev/null || { cat "$log"; fail "the service exited while starting"; }
    sleep 0.5
done
curl -fsS "$base/ready" >/dev/null || { cat "$log"; fail "not ready"; }
# The key from the credential is required; without it, 401.
status="$(curl -s -o /dev/null -w '%{http_code}' "$base/v1/models")"
[ "$status" = 401 ] || fail "/v1/models without a key: $status, expected 401"
answer="$(curl -sS -w ' (HTTP %{http_code})' -H "Authorization: Bearer package-test-key" \
    "$base/v1/completions" -H 'Content-Type: application/json' \
    -d '{"prompt": "Hello", "max_tokens": 4}' 2>&1 || true)"
grep -q '"completion_tokens":4' <<<"$answer" ||
    { tail -n 20 "$log"; fail "no completion: $answer"; }
kill -TERM "$server"
status=0; wait "$server" || status=$?
[ "$status" = 0 ] || { tail -n 20 "$log"; fail "the service exited $status on SIGTERM, expected 0"; }
rm -rf "$credentials" "$log"

echo "--- purging"
dpkg --purge moe-node
for path in /usr/bin/moe-node /etc/moe-node "$unit" "$gateway_unit" /var/cache/moe-node /var/lib/moe-node \
    /etc/systemd/system/multi-user.target.wants/moe-node.service; do
    [ ! -e "$path" ] || fail "$path is left after purge"
done

echo "--- $rpm_file"
rpm -qp --info "$rpm_file" | grep -E '^(Name|Version|License)'
listed="$(rpm -qlp "$rpm_file")"
for path in /usr/bin/moe-node /etc/moe-node/moe-node.toml \
    /etc/moe-node/credentials/api_keys /etc/moe-node/credentials/control_plane_token \
    /usr/lib/systemd/system/moe-node.service /usr/lib/systemd/system/moe-node-gateway.service \
    /usr/lib/sysusers.d/moe-node.conf /usr/share/man/man1/moe-node.1.gz \
    /usr/share/doc/moe-node/README.md /usr/share/doc/moe-node/docs/configuration.md \
    /usr/share/moe-node/grafana/moe-node.json /usr/share/moe-node/prometheus/moe-node-alerts.yml; do
    grep -qx "$path" <<<"$listed" || fail "$path missing from the rpm"
done
rpm -qp --configfiles "$rpm_file" | grep -qx /etc/moe-node/moe-node.toml ||
    fail "the rpm does not keep /etc/moe-node/moe-node.toml on upgrade"
rpm -qp --scripts "$rpm_file" | grep -q 'useradd --system' || fail "the rpm does not create its user"
rpm -qp --scripts "$rpm_file" | grep -q 'cluster_secrets' || fail "the rpm makes no cluster secret"
echo "package test: ok"
