//! The S3 surface of a cluster node: the one front end of [`crate::s3`]
//! over the coordinator ([`super::engine`]). Every node accepts every
//! request and coordinates it (see [`super::coord`]).

use super::coord::Coordinator;
use std::sync::Arc;

/// The S3 service of one cluster node (or, for tests, of several nodes
/// taking requests in turn: [`crate::s3::LightningS3::rotating`]).
pub type ClusterS3 = crate::s3::LightningS3<Arc<Coordinator>>;
