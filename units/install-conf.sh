#!/bin/sh
# install-conf.sh DIR — meson install step: put DIR/dsv4.conf in place from
# DIR/dsv4.conf.example unless it already exists (honours $DESTDIR).
set -eu
dir="${DESTDIR:-}$1"
if [ ! -e "$dir/dsv4.conf" ]; then
    cp "$dir/dsv4.conf.example" "$dir/dsv4.conf"
    chmod 0644 "$dir/dsv4.conf"
fi
