//! The bench: whole-system measurements of the stack, always side by side
//! with a peer measured in the same run, with several iterations and the
//! median and spread of each figure.
//!
//! - [`fio`]: runs fio jobs and parses its JSON output;
//! - [`stats`]: median, spread, ratios;
//! - [`peers`]: NBD servers to compare (coronafs, nbdkit, qemu-nbd);
//! - [`nbd_compare`]: the NBD comparison of CoronaFS against those peers.

pub mod fio;
pub mod nbd_compare;
pub mod peers;
pub mod stats;
