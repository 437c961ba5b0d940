//! The kernel-log source: NVIDIA driver (`NVRM: Xid`), NVSwitch (`SXid`), "fallen off the bus",
//! machine-check and PCIe AER lines, and NIC driver errors ([`nic`]), read from `/dev/kmsg`.
//!
//! NVML's Xid event wait returns only the last Xid between two waits, so the kernel log is the
//! primary Xid source. [`parse`] turns lines into [`KernelEvent`]s and is shared with the
//! `gpumedic parse-log` command, so operators can check their own logs with the same code.

pub mod event;
pub mod kmsg;
pub mod nic;
pub mod nvlink5;
pub mod parse;

pub use parse::{KernelEvent, KernelEventKind, LineOrigin, LogParser, MigInstance, NvlinkFields};
