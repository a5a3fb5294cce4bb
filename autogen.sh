#!/bin/sh
# SPDX-License-Identifier: MIT
# Makes configure and the Makefile.in files from a git checkout.
set -e
cd "$(dirname "$0")"
exec autoreconf -fi "$@"
