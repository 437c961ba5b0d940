# One image with the four gpumedic services, the console and the CLI. Used by
# compose/docker-compose.yml and the Kustomize deployment; the services are chosen by the container's command.
FROM rust:1.95-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends cmake protobuf-compiler libcurl4-openssl-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --bins \
    && mkdir /out \
    && cp target/release/gpumedic target/release/gpumedic-collector target/release/gpumedic-enricher \
          target/release/gpumedic-classifier target/release/gpumedic-remediator \
          target/release/gpumedic-console /out/

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates libcurl4 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/ /usr/local/bin/
USER 65532:65532
