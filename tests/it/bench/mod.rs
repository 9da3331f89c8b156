//! The bench's commands, the ratio-to-peer checks, Ceph as a peer and
//! `bench check` (histories under faults).

mod ceph;
mod check;
mod cli;
mod ratios;
