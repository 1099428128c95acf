#!/bin/sh
# pip install inside an image build (the Dockerfile's build stage), with what the build context brings in
# docker/pip/: a wheelhouse in wheels/ (then no index is used: a machine that reaches none, see
# docker/wheelhouse.sh) and the CA bundle PIP_CA_BUNDLE names (a proxy's, where pip reaches an index through
# one: verification stays on, with that bundle).
set -eu
here=/tmp/pip
if [ -n "${PIP_CA_BUNDLE:-}" ]; then
    bundle="$here/${PIP_CA_BUNDLE#docker/pip/}"
    grep -q -- '-----BEGIN CERTIFICATE-----' "$bundle" 2>/dev/null || {
        echo "error: PIP_CA_BUNDLE=$PIP_CA_BUNDLE: no PEM certificates at $bundle (put the file in docker/pip/)" >&2
        exit 1
    }
    export PIP_CERT="$bundle"
fi
if ls "$here"/wheels/*.whl >/dev/null 2>&1; then
    export PIP_NO_INDEX=1 PIP_FIND_LINKS="$here/wheels"
fi
exec /opt/venv/bin/pip install --no-cache-dir --disable-pip-version-check "$@"
