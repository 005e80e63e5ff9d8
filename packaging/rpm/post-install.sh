# Enabled, not started: configure /etc/moe-node/moe-node.toml, then `systemctl start moe-node`.
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null 2>&1 || :
fi
if [ "$1" -eq 1 ]; then
    systemctl enable moe-node.service >/dev/null 2>&1 || :
fi
