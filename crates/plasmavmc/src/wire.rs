//! The bottom of the crate: what crosses the wire between the control plane
//! and its workers, and the rules names must follow.
//!
//! The agent's DTOs are here, not in the agent's server, because both ends
//! use them: [`crate::agent`] serves them and [`crate::worker::remote`]
//! sends them; the in-process worker takes the same types, so both
//! [`crate::worker::Worker`] implementations answer alike.
//!
//! The agent's HTTP API:
//!
//! | method | path | body | answer |
//! |---|---|---|---|
//! | GET | `/healthz` | | `ok NAME` |
//! | GET | `/v1/attachments` | | `[`[`Report`]`]` |
//! | POST | `/v1/attachments` | [`Attach`] | 201 [`Report`] |
//! | GET | `/v1/attachments/{vm}` | | [`Report`] with the write log |
//! | POST | `/v1/attachments/{vm}/flush` | [`FlushReq`] | [`Report`] |
//! | POST | `/v1/attachments/{vm}/verify` | [`VerifyReq`] | [`Verified`] |
//! | POST | `/v1/attachments/{vm}/io` | [`StartIo`] | 204 |
//! | DELETE | `/v1/attachments/{vm}` | | 204 |
//!
//! Errors answer `{"error": "..."}` ([`ApiError`]) with the
//! status of [`PlasmaError::http_status`]. With a token (`plasmavmc agent
//! --api-token-file`), every route but `GET /healthz` needs
//! `Authorization: Bearer TOKEN`, else 401 ([`unauthorized`]).

use crate::error::{PlasmaError, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The 401 body of a request without the API token (the REST API's and the
/// agent's): the usual `{"error"}`.
pub fn unauthorized(message: String) -> axum::response::Response {
    use axum::response::IntoResponse;
    (axum::http::StatusCode::UNAUTHORIZED, axum::Json(ApiError { error: message })).into_response()
}

/// What the guest has written and had acknowledged: block -> last seq.
pub type WriteLog = BTreeMap<u64, u64>;

/// Worker names: `[A-Za-z0-9._-]{1,64}` (they appear in URLs and logs).
pub fn check_worker(w: &str) -> Result<()> {
    let ok = !w.is_empty() && w.len() <= 64 && w.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if ok { Ok(()) } else { Err(PlasmaError::Invalid(format!("worker {w:?} must match [A-Za-z0-9._-]{{1,64}}"))) }
}

/// Image names: 1 to 255 bytes, no control characters (they are shown,
/// never used as keys: images are stored under their ids).
pub fn check_image_name(name: &str) -> Result<()> {
    if name.is_empty() || name.len() > 255 || name.chars().any(char::is_control) {
        return Err(PlasmaError::Invalid("name must be 1..=255 printable characters".into()));
    }
    Ok(())
}

/// The JSON error body of every failing call, of the REST API and of the
/// agent's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApiError {
    pub error: String,
}

/// Body of `POST /v1/attachments`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Attach {
    pub vm_id: String,
    /// CoronaFS volume name.
    pub volume: String,
    /// Epoch to declare when opening the export.
    pub epoch: u64,
    /// Guest writes to start right away (0: attach only).
    #[serde(default)]
    pub io_ops: u64,
    /// First write's sequence number.
    #[serde(default)]
    pub seq_start: u64,
}

/// Body of `POST /v1/attachments/{vm}/flush`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FlushReq {
    /// Stop guest I/O first, so the returned log is final.
    #[serde(default)]
    pub pause: bool,
}

/// Body of `POST /v1/attachments/{vm}/verify`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VerifyReq {
    /// Blocks and the write each must hold (or a later one).
    pub log: WriteLog,
    /// Make what was found this guest's log (the target of a migration).
    #[serde(default)]
    pub adopt: bool,
}

/// Body of `POST /v1/attachments/{vm}/io`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StartIo {
    pub ops: u64,
    #[serde(default)]
    pub seq_start: u64,
}

/// An attachment's state as reported to the control plane.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Report {
    pub vm_id: String,
    pub worker: String,
    /// CoronaFS volume name.
    pub volume: String,
    pub epoch: u64,
    /// Guest I/O is running.
    pub running: bool,
    /// Writes acknowledged on this attachment.
    pub writes_acked: u64,
    /// The next write's sequence number.
    pub next_seq: u64,
    /// Acknowledged writes: block -> seq. After a flush report, all flushed.
    /// After a reconnect, writes acknowledged since the last FLUSH before it
    /// are dropped (the server may have lost them).
    pub log: WriteLog,
    /// Why the guest stopped early (fenced, I/O error), if it did.
    pub stopped_by: Option<String>,
    /// Times the NBD connection broke and was opened again.
    #[serde(default)]
    pub reconnects: u64,
}

/// Result of reading back a log on an attachment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Verified {
    /// Blocks that hold their logged write or a later one.
    pub verified: u64,
    /// Highest seq found on the volume among the checked blocks.
    pub max_seq: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_names_are_short_and_url_safe() {
        for ok in ["w1", "node-02", "a.b_c", &"x".repeat(64)] {
            check_worker(ok).unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        for bad in ["", "bad worker!", "a/b", "é", &"x".repeat(65)] {
            assert!(check_worker(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn image_names_are_printable_and_bounded() {
        check_image_name("ubuntu 24.04 (noble) — cloud").expect("valid");
        for bad in ["", "a\nb", "tab\there", &"x".repeat(256)] {
            assert!(check_image_name(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn agent_bodies_round_trip_and_refuse_unknown_fields() {
        let a = Attach { vm_id: "vm-1".into(), volume: "v".into(), epoch: 3, io_ops: 0, seq_start: 9 };
        let back: Attach = serde_json::from_str(&serde_json::to_string(&a).expect("encode")).expect("decode");
        assert_eq!(back, a);
        let e = serde_json::from_str::<FlushReq>(r#"{"pause":true,"bogus":1}"#).expect_err("unknown field");
        assert!(e.to_string().contains("bogus"), "{e}");
        let v: VerifyReq = serde_json::from_str(r#"{"log":{"3":7}}"#).expect("defaults");
        assert_eq!((v.log.get(&3), v.adopt), (Some(&7), false));
    }
}
