#!/usr/bin/env bash
# Re-fetch the vendored widget JavaScript from the npm registry (see README.md beside this file).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"
npm pack --silent @jupyter-widgets/html-manager@1.0.15 requirejs@2.3.8 >/dev/null
for f in *.tgz; do mkdir "${f%.tgz}" && tar xzf "$f" -C "${f%.tgz}"; done
cp jupyter-widgets-html-manager-*/package/dist/embed-amd.js "$here/"
cp jupyter-widgets-html-manager-*/package/dist/*.woff2 "$here/../@jupyter-widgets/"
cp jupyter-widgets-html-manager-*/package/dist/embed.js.LICENSE.txt "$here/embed-amd.js.LICENSE.txt"
cp requirejs-*/package/require.js "$here/"
echo "vendored into $here"
