//! The bench: whole-system measurements of the stack, always side by side
//! with a peer measured in the same run, with several iterations and the
//! median and spread of each figure.
//!
//! - [`check`]: `bench check`'s checkers over histories of client operations
//!   under faults (linearizability, read-your-writes, set, blocks), pure;
//! - [`checkrun`]: `bench check`, workloads recorded under a nemesis, then checked;
//! - [`agent`]: `bench agent`, the load generator as a service on every node;
//! - [`fault`]: faults applied during a run (`--fault kill:lightningstor@node02`)
//!   and the Docker lab's driver (containers through the engine's socket);
//! - [`job`]: job files and profiles (fio's vocabulary in TOML), pure;
//! - [`target`]: `--target` URIs (NBD, path, S3);
//! - [`loadgen`], [`files`], [`hist`]: our own load generator;
//! - [`runner`]: `bench run`, a profile over several iterations;
//! - [`compare`]: `bench compare`, regressions between two result files;
//! - [`accuracy`]: our load generator against fio on the same target;
//! - [`shaper`], [`netprobe`]: link emulation and the TCP baseline;
//! - [`cluster`]: the embedded (or deployed) cluster the storage bench measures;
//! - [`storage`], [`charts`], [`progress`]: `fresh-bench-storage`;
//! - [`fio`]: runs fio jobs and parses its JSON output;
//! - [`healthcheck`]: `bench healthcheck`, does a service answer (HTTP, NBD, TCP);
//! - [`qcow2`]: a small qcow2 writer for the VM image test images;
//! - [`stats`]: median, spread, ratios; [`text`]: counts with their nouns;
//! - [`peers`], [`nbd_compare`]: CoronaFS against nbdkit and qemu-nbd.

pub mod accuracy;
pub mod agent;
pub mod aio;
pub mod ceph;
pub mod charts;
pub mod check;
pub mod checkrun;
pub mod cluster;
pub mod compare;
pub mod cpu;
pub mod fault;
pub mod files;
pub mod fio;
pub mod healthcheck;
pub mod hist;
pub mod job;
pub mod loadgen;
pub mod nbd_compare;
pub mod netprobe;
pub mod peers;
pub mod ports;
pub mod progress;
pub mod qcow2;
pub mod runner;
pub mod shaper;
pub mod stats;
pub mod storage;
pub mod target;
pub mod text;
