//! Test doubles of the services, in a crate of their own so that no release
//! build compiles them and no test has to turn on a feature of a service
//! crate (which would build it twice, with and without the feature). Only
//! test code depends on it, as a dev-dependency: the tests crate
//! (`stack-tests`) and bench's benchmarks.
//!
//! - [`lightningstor`]: the fault-injecting transport and the in-process
//!   cluster it connects.
//! - [`s3`]: a deliberately broken S3 service (stale GETs), for the
//!   self-check of `bench check`'s checkers.
//! - [`sdk`]: aws-sdk-s3's HTTP client wired straight to an s3s service in
//!   this process (the tests' and the gate's in-process S3 path).
//!
//! CoronaFS's doubles (the crash and fault backends, fail points in volume
//! changes) stay inside `coronafs` behind `cfg(any(test, feature = "testing"))`:
//! the server serves them through its `AnyBackend` enum, which a crate
//! outside cannot extend, and only coronafs's own unit tests use them.

pub mod lightningstor;
pub mod s3;
pub mod sdk;
