# On removal (not upgrade): stop and disable the service.
if [ "$1" -eq 0 ]; then
    systemctl --no-reload disable --now moe-node.service >/dev/null 2>&1 || :
fi
