if [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null 2>&1 || :
fi
if [ "$1" -eq 0 ]; then
    rm -rf /var/cache/moe-node /var/lib/moe-node
fi
