#!/bin/sh
# As the redis image's entrypoint does: started as root (so the compose entrypoint can read the password secret
# and write redis's config), redis-server runs as the redis user, owner of /data.
set -e
if [ "$(id -u)" = 0 ] && [ "${1:-}" = redis-server ]; then
    find /data \! -user redis -exec chown redis:redis {} + 2>/dev/null || true
    exec setpriv --reuid=redis --regid=redis --init-groups "$@"
fi
exec "$@"
