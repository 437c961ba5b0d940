//! Generates the ingest API's Rust code, and the kubelet PodResources client the collector uses,
//! from proto/ with tonic (protoc from Debian's protobuf-compiler, installed by compose/up).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=gpumedic");
    println!("cargo:rerun-if-changed=k8s");
    tonic_prost_build::configure()
        .compile_protos(&["gpumedic/ingest/v1/ingest.proto", "k8s/podresources/v1/api.proto"], &["."])?;
    Ok(())
}
