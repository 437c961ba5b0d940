# One image with the four gpumedic services, the console and the CLI. Used by
# compose/docker-compose.yml and the Kustomize deployment; the services are chosen by the container's command.
FROM rust:1.95-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends cmake protobuf-compiler libcurl4-openssl-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# The collector alone first: built with the workspace, cargo would unify features and link the
# other services' sqlx and kube into the DaemonSet that runs on every GPU node (docs/benchmarks.md
# has its size and memory either way). Then the rest, without the collector's binary.
RUN cargo build --release --locked -p gpumedic-collector \
    && mkdir /out \
    && cp target/release/gpumedic-collector /out/ \
    && cargo build --release --locked --workspace --exclude gpumedic-collector --exclude gpumedic-load-tests --bins \
    && cp target/release/gpumedic target/release/gpumedic-enricher \
          target/release/gpumedic-classifier target/release/gpumedic-remediator \
          target/release/gpumedic-console /out/

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates libcurl4 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/ /usr/local/bin/
USER 65532:65532
