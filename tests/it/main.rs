//! The integration tests of the whole stack, in one binary: real clients
//! (qemu, libnbd, fio, aws-sdk-s3, nbdkit, Ceph) against the services, in
//! process and as spawned binaries. One module per area:
//!
//! - [`s3`]: LightningStor through aws-sdk-s3, single node and cluster;
//! - [`nbd`]: CoronaFS through NBD clients and its control API;
//! - [`vmc`]: PlasmaVMC with LightningStor and CoronaFS;
//! - [`bench`]: the bench's commands, the ratio-to-peer checks, Ceph as a peer;
//! - [`lab`]: the Docker lab;
//! - [`readme`]: the README's by-hand blocks, as written.
//!
//! One binary links the stack and aws-sdk-s3 once (they were sixteen, each
//! linking them: docs/building.md). Its tests run on parallel threads;
//! [`gate`] keeps the measuring ones alone.

mod bench;
mod gate;
mod lab;
mod nbd;
mod readme;
mod s3;
mod vmc;
