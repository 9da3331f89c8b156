//! PlasmaVMC with a real LightningStor and a real CoronaFS.

mod agents;
mod api;
pub mod common;
