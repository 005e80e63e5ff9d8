# The service's user, as packaging/moe-node.sysusers declares it.
getent group moe-node >/dev/null || groupadd --system moe-node
getent passwd moe-node >/dev/null || useradd --system --gid moe-node \
    --home-dir /var/lib/moe-node --no-create-home --shell /usr/sbin/nologin \
    --comment "moe-node serving node" moe-node
exit 0
