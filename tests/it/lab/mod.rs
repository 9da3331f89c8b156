//! The Docker lab of `deploy/docker`.

mod docker;
