//! Node-to-node authentication for the replica RPC: a mutual HMAC-SHA256
//! challenge before the first frame of every connection.
//!
//! Every node holds the cluster file's `rpc_secret` (32 random bytes as 64
//! hex digits). On a new connection:
//!
//! ```text
//! listener -> caller    MAGIC (8) | Nl (32 random bytes)
//! caller   -> listener  Nc (32 random bytes) | HMAC(secret, "caller" | Nl | Nc)
//! listener -> caller    HMAC(secret, "listener" | Nc | Nl)
//! ```
//!
//! The listener checks the caller's tag before it reads any frame, and the
//! caller checks the listener's before it sends one: a process without the
//! secret can neither write to a replica nor pose as one. Fresh nonces make a
//! recorded exchange useless on another connection; the labels keep one
//! side's tag from being reflected as the other's. The frames after it are
//! neither encrypted nor signed (the RPC is for the cluster's own network).
//!
//! The same scheme as LightningStor's `cluster/auth.rs`, kept apart (with its
//! own magic) so that neither crate depends on the other. Pure functions;
//! `backend/replicated/link.rs` and `server/replica.rs` do the I/O.

use crate::error::{CoronaError, Result};
use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

/// Bytes of the secret.
pub const SECRET_LEN: usize = 32;
/// Bytes of a nonce and of a tag.
pub const NONCE_LEN: usize = 32;
/// The listener's greeting.
pub const HELLO_LEN: usize = 8 + NONCE_LEN;
/// The caller's answer: its nonce and its tag.
pub const ANSWER_LEN: usize = NONCE_LEN + 32;
/// The listener's proof.
pub const PROOF_LEN: usize = 32;
/// Names the protocol and its version, so anything else fails clearly.
const MAGIC: &[u8; 8] = b"CFSREP\x00\x01";

/// The cluster's shared RPC secret. `Debug` never prints it.
#[derive(Clone, PartialEq, Eq)]
pub struct RpcSecret([u8; SECRET_LEN]);

impl std::fmt::Debug for RpcSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RpcSecret(..)")
    }
}

impl RpcSecret {
    /// Parses 64 hex digits.
    pub fn parse(hex_text: &str) -> Result<Self> {
        let bytes = hex::decode(hex_text.trim()).map_err(|_| bad_secret())?;
        let arr: [u8; SECRET_LEN] = bytes.try_into().map_err(|_| bad_secret())?;
        Ok(RpcSecret(arr))
    }

    /// A new random secret.
    pub fn random() -> Result<Self> {
        let mut b = [0u8; SECRET_LEN];
        fill(&mut b)?;
        Ok(RpcSecret(b))
    }

    /// The 64 hex digits a cluster file holds.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    fn tag(&self, label: &[u8], first: &[u8; NONCE_LEN], second: &[u8; NONCE_LEN]) -> Hmac<Sha256> {
        // HMAC takes a key of any length, so this cannot fail.
        let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(&self.0).expect("HMAC takes any key length");
        mac.update(label);
        mac.update(first);
        mac.update(second);
        mac
    }
}

fn bad_secret() -> CoronaError {
    CoronaError::Config(format!("rpc_secret must be {} hex digits (32 random bytes)", SECRET_LEN * 2))
}

fn refused(why: &str) -> CoronaError {
    CoronaError::Replica(format!("rpc handshake refused: {why}"))
}

fn fill(buf: &mut [u8]) -> Result<()> {
    getrandom::fill(buf).map_err(|e| CoronaError::Io(std::io::Error::other(format!("no random bytes: {e}"))))
}

/// A fresh nonce.
pub fn nonce() -> Result<[u8; NONCE_LEN]> {
    let mut n = [0u8; NONCE_LEN];
    fill(&mut n)?;
    Ok(n)
}

/// The listener's greeting carrying its nonce.
pub fn hello(listener_nonce: &[u8; NONCE_LEN]) -> [u8; HELLO_LEN] {
    let mut out = [0u8; HELLO_LEN];
    out[..8].copy_from_slice(MAGIC);
    out[8..].copy_from_slice(listener_nonce);
    out
}

/// The listener's nonce, if the greeting is ours.
pub fn parse_hello(msg: &[u8; HELLO_LEN]) -> Result<[u8; NONCE_LEN]> {
    if &msg[..8] != MAGIC {
        return Err(refused("the peer is not a CoronaFS replica listener of this protocol version"));
    }
    let mut n = [0u8; NONCE_LEN];
    n.copy_from_slice(&msg[8..]);
    Ok(n)
}

/// The caller's answer to a greeting.
pub fn answer(
    secret: &RpcSecret,
    listener_nonce: &[u8; NONCE_LEN],
    caller_nonce: &[u8; NONCE_LEN],
) -> [u8; ANSWER_LEN] {
    let tag = secret.tag(b"caller", listener_nonce, caller_nonce).finalize().into_bytes();
    let mut out = [0u8; ANSWER_LEN];
    out[..NONCE_LEN].copy_from_slice(caller_nonce);
    out[NONCE_LEN..].copy_from_slice(&tag);
    out
}

/// Checks a caller's answer in constant time; gives the caller's nonce.
pub fn check_answer(
    secret: &RpcSecret,
    listener_nonce: &[u8; NONCE_LEN],
    msg: &[u8; ANSWER_LEN],
) -> Result<[u8; NONCE_LEN]> {
    let mut caller_nonce = [0u8; NONCE_LEN];
    caller_nonce.copy_from_slice(&msg[..NONCE_LEN]);
    secret
        .tag(b"caller", listener_nonce, &caller_nonce)
        .verify_slice(&msg[NONCE_LEN..])
        .map_err(|_| refused("the caller does not hold this cluster's rpc_secret"))?;
    Ok(caller_nonce)
}

/// The listener's proof that it holds the secret too.
pub fn proof(secret: &RpcSecret, caller_nonce: &[u8; NONCE_LEN], listener_nonce: &[u8; NONCE_LEN]) -> [u8; PROOF_LEN] {
    secret.tag(b"listener", caller_nonce, listener_nonce).finalize().into_bytes().into()
}

/// Checks the listener's proof in constant time.
pub fn check_proof(
    secret: &RpcSecret,
    caller_nonce: &[u8; NONCE_LEN],
    listener_nonce: &[u8; NONCE_LEN],
    msg: &[u8; PROOF_LEN],
) -> Result<()> {
    secret
        .tag(b"listener", caller_nonce, listener_nonce)
        .verify_slice(msg)
        .map_err(|_| refused("the listener does not hold this cluster's rpc_secret"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn secret(b: u8) -> RpcSecret {
        RpcSecret([b; SECRET_LEN])
    }

    #[test]
    fn both_sides_with_the_secret_accept_each_other() {
        let s = secret(7);
        let (nl, nc) = ([1u8; 32], [2u8; 32]);
        let got = parse_hello(&hello(&nl)).expect("hello");
        assert_eq!(got, nl);
        let a = answer(&s, &got, &nc);
        assert_eq!(check_answer(&s, &nl, &a).expect("caller accepted"), nc);
        check_proof(&s, &nc, &nl, &proof(&s, &nc, &nl)).expect("listener accepted");
    }

    #[test]
    fn a_caller_or_listener_with_another_secret_is_refused() {
        let (nl, nc) = ([1u8; 32], [2u8; 32]);
        let e = check_answer(&secret(7), &nl, &answer(&secret(8), &nl, &nc)).expect_err("refused");
        assert!(e.to_string().contains("rpc_secret"), "{e}");
        assert!(check_proof(&secret(7), &nc, &nl, &proof(&secret(8), &nc, &nl)).is_err());
    }

    #[test]
    fn a_recorded_answer_or_a_reflected_tag_is_refused() {
        let s = secret(7);
        let a = answer(&s, &[1u8; 32], &[2u8; 32]);
        assert!(check_answer(&s, &[3u8; 32], &a).is_err(), "replayed to another greeting");
        let (nl, nc) = ([1u8; 32], [2u8; 32]);
        let mut forged = [0u8; ANSWER_LEN];
        forged[..32].copy_from_slice(&nc);
        forged[32..].copy_from_slice(&proof(&s, &nl, &nc));
        assert!(check_answer(&s, &nl, &forged).is_err(), "the listener's tag reflected");
    }

    #[test]
    fn a_greeting_of_another_protocol_is_refused() {
        let mut h = hello(&[1u8; 32]);
        h[0] = b'L';
        assert!(parse_hello(&h).is_err());
    }

    #[test]
    fn secrets_parse_from_64_hex_digits_only_and_never_print() {
        let s = RpcSecret::random().expect("random");
        assert_eq!(RpcSecret::parse(&s.to_hex()).expect("round trip"), s);
        assert!(RpcSecret::parse("abcd").is_err());
        assert!(RpcSecret::parse(&"zz".repeat(32)).is_err());
        assert!(RpcSecret::parse(&"00".repeat(33)).is_err());
        assert_eq!(format!("{s:?}"), "RpcSecret(..)");
    }

    proptest! {
        #[test]
        fn any_changed_byte_of_an_answer_is_refused(i in 0usize..ANSWER_LEN, x in 1u8..=255) {
            let s = secret(9);
            let (nl, nc) = ([4u8; 32], [5u8; 32]);
            let mut a = answer(&s, &nl, &nc);
            a[i] ^= x;
            prop_assert!(check_answer(&s, &nl, &a).is_err());
        }
    }
}
