# An application's image on slipstream's: the application's wheels installed into the image's
# virtual environment, /opt/slipstream, whose own pip is left out of the image.  A build stage
# of the base (which has Python's venv and pip) copies the environment, installs the wheels
# into it with a pip of its own (`pip --python`), and the image takes the environment back:
#
#   podman build --format docker -f Containerfile.app -t my-app CONTEXT
#
# CONTEXT holds wheels/ (your application's wheels and its dependencies', e.g. `pip wheel
# -w wheels .`; nothing is fetched: --no-index).  --format docker keeps the driver's
# HEALTHCHECK, which the OCI format has no field for.  The application runs as the image's
# user or as any uid with the driver's group (docs/OPERATIONS.md, Deployment).
ARG SLIPSTREAM_IMAGE=localhost/slipstream:latest
ARG BASE_IMAGE=localhost/slipstream-base:bookworm
FROM ${SLIPSTREAM_IMAGE} AS slipstream

FROM ${BASE_IMAGE} AS build
# Podman keeps this stage's image, untagged, after the build: an id of the build here
# (--build-arg BUILD_STAGE_ID=...) lets it be found and removed (podman rmi, filtered by
# the label); without one, `podman image prune` removes it with the other untagged images.
ARG BUILD_STAGE_ID=
LABEL org.slipstream.build-stage=${BUILD_STAGE_ID}
COPY --from=slipstream /opt/slipstream /opt/slipstream
COPY wheels/ /wheels/
RUN python3 -m venv /tmp/installer && \
    /tmp/installer/bin/pip --python /opt/slipstream/bin/python install --quiet \
        --disable-pip-version-check --no-index /wheels/*.whl

FROM ${SLIPSTREAM_IMAGE}
COPY --from=build /opt/slipstream /opt/slipstream
