# gpumedic's images, all from this file, built from the repository root. Each runs as UID 65532.
#
# - The default (the last stage): one image with the four services, the console and the CLI. Used
#   by compose/docker-compose.yml and the Kustomize deployment; the container's command picks the
#   service.
#       docker build -t gpumedic .
# - One service's image, its binary alone on a slim Debian, for registries that scan or sign per
#   component (SERVICE is collector, enricher, classifier, remediator or console):
#       docker build --target service --build-arg SERVICE=collector -t gpumedic-collector .

# The toolchain and the source, shared by both builds.
FROM rust:1.95-bookworm AS source
RUN apt-get update && apt-get install -y --no-install-recommends cmake protobuf-compiler libcurl4-openssl-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .

# What every image runs on.
FROM debian:bookworm-slim AS runtime
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates libcurl4 \
    && rm -rf /var/lib/apt/lists/*
USER 65532:65532

# One service built alone (`-p`), so it links only its own dependencies: the collector, a
# DaemonSet on every GPU node, neither sqlx nor kube.
FROM source AS service-build
ARG SERVICE
RUN test -n "$SERVICE" || { echo "Give the service: --build-arg SERVICE=collector (or enricher, classifier, remediator, console)." >&2; exit 1; }
RUN --mount=type=cache,target=/usr/local/cargo/registry --mount=type=cache,target=/src/target \
    cargo build --release --locked -p "gpumedic-$SERVICE" \
    && mkdir /out \
    && cp "target/release/gpumedic-$SERVICE" /out/

# One service's image. The workloads name their binary as the command (gpumedic-collector, ...),
# as with the default image; `docker run` starts it through the entrypoint. An exec-form
# ENTRYPOINT takes no build argument, so a shell names the binary and hands it the process (exec):
# the service runs as PID 1 and receives SIGTERM itself.
FROM runtime AS service
ARG SERVICE
COPY --from=service-build /out/ /usr/local/bin/
ENV SERVICE_BINARY=/usr/local/bin/gpumedic-$SERVICE
ENTRYPOINT ["/bin/sh", "-c", "exec \"$SERVICE_BINARY\" \"$@\"", "gpumedic"]

# Every binary. The collector alone first: built with the workspace, cargo would unify features
# and link the other services' sqlx and kube into the DaemonSet that runs on every GPU node
# (docs/benchmarks.md has its size and memory either way). Then the rest, without the collector's
# binary.
FROM source AS build
RUN cargo build --release --locked -p gpumedic-collector \
    && mkdir /out \
    && cp target/release/gpumedic-collector /out/ \
    && cargo build --release --locked --workspace --exclude gpumedic-collector --exclude gpumedic-load-tests --bins \
    && cp target/release/gpumedic target/release/gpumedic-enricher \
          target/release/gpumedic-classifier target/release/gpumedic-remediator \
          target/release/gpumedic-console /out/

# The default image: every service, the console and the CLI.
FROM runtime
COPY --from=build /out/ /usr/local/bin/
