# Enabled, not started: configure /etc/moe-node/moe-node.toml, then `systemctl start moe-node`.
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null 2>&1 || :
fi
if [ "$1" -eq 1 ]; then
    systemctl enable moe-node.service >/dev/null 2>&1 || :
fi
# A cluster secret of 128 random bits, made here once rather than shipped: every node of one
# cluster needs the same, so copy this file to the others (docs/security.md).
secrets=/etc/moe-node/credentials/cluster_secrets
if [ -f "$secrets" ] && ! grep -q '^[^#[:space:]]' "$secrets"; then
    od -An -N16 -tx1 /dev/urandom | tr -d ' \n' >>"$secrets"
    echo >>"$secrets"
fi
