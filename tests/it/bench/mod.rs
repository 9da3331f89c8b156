//! The bench's commands, the ratio-to-peer checks and Ceph as a peer.

mod ceph;
mod cli;
mod ratios;
