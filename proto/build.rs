//! Generates the ingest API's Rust code from proto/ with tonic (protoc from Debian's
//! protobuf-compiler, installed by compose/up).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=gpumedic");
    tonic_prost_build::configure().compile_protos(&["gpumedic/ingest/v1/ingest.proto"], &["."])?;
    Ok(())
}
