#!/bin/sh
# The official image's start: the default user from RABBITMQ_DEFAULT_USER and RABBITMQ_DEFAULT_PASS, reachable
# from other containers, then the server in place of this shell, as the rabbitmq user.
set -eu
if [ "$(id -u)" = 0 ]; then
    cat > /etc/rabbitmq/rabbitmq.conf <<CONF
loopback_users = none
listeners.tcp.default = 5672
management.tcp.port = 15672
log.console = true
default_user = ${RABBITMQ_DEFAULT_USER:-guest}
default_pass = ${RABBITMQ_DEFAULT_PASS:-guest}
CONF
    chown rabbitmq:rabbitmq /etc/rabbitmq/rabbitmq.conf && chmod 0600 /etc/rabbitmq/rabbitmq.conf
    chown -R rabbitmq:rabbitmq /var/lib/rabbitmq
    exec setpriv --reuid rabbitmq --regid rabbitmq --init-groups "$0" "$@"
fi
exec "$@"
