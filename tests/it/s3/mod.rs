//! LightningStor through aws-sdk-s3.

mod api;
mod cluster;
pub mod common;
mod crash;
