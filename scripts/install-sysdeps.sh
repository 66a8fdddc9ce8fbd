#!/bin/sh
# Installs the Debian packages pdgate's simulator and tests need.
set -eu
packages="libibverbs1 redis-server prometheus"
if [ "$(id -u)" -eq 0 ]; then sudo=""; else sudo="sudo"; fi
echo "Installing Debian packages: $packages"
$sudo apt-get update -q >/dev/null
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends $packages >/dev/null
