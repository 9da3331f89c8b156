//! Node-to-node authentication for a cluster's RPC: a mutual HMAC-SHA256
//! challenge on every connection, before its first frame. LightningStor's
//! node RPC and CoronaFS's replica RPC both use it, each under its own
//! [`Protocol`] (magic bytes), so a node of one never talks to the other.
//!
//! Every node of a cluster holds the cluster file's `rpc_secret` (32 random
//! bytes, written as 64 hex digits). On a new connection:
//!
//! ```text
//! listener -> caller    MAGIC (8) | Nl (32 random bytes)
//! caller   -> listener  Nc (32 random bytes) | HMAC-SHA256(secret, "caller" | Nl | Nc)
//! listener -> caller    HMAC-SHA256(secret, "listener" | Nc | Nl)
//! ```
//!
//! The listener checks the caller's tag before it reads any request; the
//! caller checks the listener's before it sends one. So a process without
//! the secret can neither give a node an order nor pose as a node to a
//! caller. Both nonces are fresh, so a recorded exchange is worth nothing on
//! another connection, and the two tags differ by their label, so one side's
//! tag cannot be reflected back. Tags are compared in constant time. What
//! this does not do: encrypt or sign the frames that follow. The RPC is
//! meant for the cluster's own network; an attacker who can rewrite TCP
//! segments there could still hijack an authenticated connection (TLS or a
//! Noise transport would close that, at a cost on every block sent).
//!
//! The message functions here are pure; [`io`] runs them over a stream.

pub mod io;

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

/// Bytes of the secret.
pub const SECRET_LEN: usize = 32;
/// Bytes of a nonce and of a tag.
pub const NONCE_LEN: usize = 32;
/// The listener's first message: the magic and its nonce.
pub const HELLO_LEN: usize = 8 + NONCE_LEN;
/// The caller's answer: its nonce and its tag.
pub const ANSWER_LEN: usize = NONCE_LEN + 32;
/// The listener's proof.
pub const PROOF_LEN: usize = 32;

/// Which RPC a connection speaks: its magic names the protocol and its
/// version, so that a peer of another version (or something that is not a
/// node at all) fails clearly instead of garbling frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Protocol {
    /// The first 8 bytes the listener sends.
    pub magic: [u8; 8],
    /// What a listener of this protocol is, for errors ("a LightningStor node").
    pub listener: &'static str,
}

/// Why a handshake, or the secret it needs, failed.
#[derive(Debug, thiserror::Error)]
pub enum RpcAuthError {
    /// The configured secret is not 64 hex digits.
    #[error("rpc_secret must be {} hex digits (32 random bytes)", SECRET_LEN * 2)]
    BadSecret,
    /// The operating system gave no random bytes.
    #[error("no random bytes: {0}")]
    NoRandom(String),
    /// The peer failed the handshake (or is not a peer of this protocol).
    #[error("rpc handshake refused: {0}")]
    Refused(String),
    /// The connection failed during the handshake.
    #[error("rpc handshake: {0}")]
    Io(#[from] std::io::Error),
}

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
    pub fn parse(hex_text: &str) -> Result<Self, RpcAuthError> {
        let bytes = hex::decode(hex_text.trim()).map_err(|_| RpcAuthError::BadSecret)?;
        let arr: [u8; SECRET_LEN] = bytes.try_into().map_err(|_| RpcAuthError::BadSecret)?;
        Ok(RpcSecret(arr))
    }

    /// A new random secret (the operating system's generator).
    pub fn random() -> Result<Self, RpcAuthError> {
        let mut b = [0u8; SECRET_LEN];
        fill(&mut b)?;
        Ok(RpcSecret(b))
    }

    /// The 64 hex digits a cluster file holds.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    fn tag(&self, label: &[u8], first: &[u8; NONCE_LEN], second: &[u8; NONCE_LEN]) -> Hmac<Sha256> {
        // An HMAC key may have any length: this cannot fail.
        let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(&self.0).expect("HMAC takes any key length");
        mac.update(label);
        mac.update(first);
        mac.update(second);
        mac
    }
}

fn refused(why: &str) -> RpcAuthError {
    RpcAuthError::Refused(why.to_owned())
}

/// Fills `buf` with random bytes from the operating system.
pub fn fill(buf: &mut [u8]) -> Result<(), RpcAuthError> {
    getrandom::fill(buf).map_err(|e| RpcAuthError::NoRandom(e.to_string()))
}

/// A fresh nonce.
pub fn nonce() -> Result<[u8; NONCE_LEN], RpcAuthError> {
    let mut n = [0u8; NONCE_LEN];
    fill(&mut n)?;
    Ok(n)
}

impl Protocol {
    /// The listener's greeting carrying its nonce.
    pub fn hello(&self, listener_nonce: &[u8; NONCE_LEN]) -> [u8; HELLO_LEN] {
        let mut out = [0u8; HELLO_LEN];
        out[..8].copy_from_slice(&self.magic);
        out[8..].copy_from_slice(listener_nonce);
        out
    }

    /// The listener's nonce from its greeting, if the greeting is of this protocol.
    pub fn parse_hello(&self, msg: &[u8; HELLO_LEN]) -> Result<[u8; NONCE_LEN], RpcAuthError> {
        if msg[..8] != self.magic {
            return Err(refused(&format!("the peer is not {} of this protocol version", self.listener)));
        }
        let mut n = [0u8; NONCE_LEN];
        n.copy_from_slice(&msg[8..]);
        Ok(n)
    }
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

/// Checks a caller's answer (in constant time); gives the caller's nonce.
pub fn check_answer(
    secret: &RpcSecret,
    listener_nonce: &[u8; NONCE_LEN],
    msg: &[u8; ANSWER_LEN],
) -> Result<[u8; NONCE_LEN], RpcAuthError> {
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

/// Checks the listener's proof (in constant time).
pub fn check_proof(
    secret: &RpcSecret,
    caller_nonce: &[u8; NONCE_LEN],
    listener_nonce: &[u8; NONCE_LEN],
    msg: &[u8; PROOF_LEN],
) -> Result<(), RpcAuthError> {
    secret
        .tag(b"listener", caller_nonce, listener_nonce)
        .verify_slice(msg)
        .map_err(|_| refused("the listener does not hold this cluster's rpc_secret"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const P: Protocol = Protocol { magic: *b"TEST\x00\x00\x00\x01", listener: "a test node" };

    fn secret(b: u8) -> RpcSecret {
        RpcSecret([b; SECRET_LEN])
    }

    #[test]
    fn both_sides_with_the_secret_accept_each_other() {
        let s = secret(7);
        let (nl, nc) = ([1u8; 32], [2u8; 32]);
        let got = P.parse_hello(&P.hello(&nl)).expect("hello");
        assert_eq!(got, nl);
        let a = answer(&s, &got, &nc);
        assert_eq!(check_answer(&s, &nl, &a).expect("caller accepted"), nc);
        check_proof(&s, &nc, &nl, &proof(&s, &nc, &nl)).expect("listener accepted");
    }

    #[test]
    fn a_caller_or_a_listener_with_another_secret_is_refused() {
        let (nl, nc) = ([1u8; 32], [2u8; 32]);
        let e = check_answer(&secret(7), &nl, &answer(&secret(8), &nl, &nc)).expect_err("refused");
        assert!(e.to_string().contains("rpc_secret"), "{e}");
        assert!(check_proof(&secret(7), &nc, &nl, &proof(&secret(8), &nc, &nl)).is_err());
    }

    #[test]
    fn an_answer_recorded_for_one_greeting_fails_for_another() {
        let s = secret(7);
        let a = answer(&s, &[1u8; 32], &[2u8; 32]);
        assert!(check_answer(&s, &[3u8; 32], &a).is_err());
    }

    #[test]
    fn a_tag_cannot_be_reflected_to_the_other_side() {
        // The listener's proof over (Nc, Nl) is not a caller tag over the same nonces.
        let s = secret(7);
        let (nl, nc) = ([1u8; 32], [2u8; 32]);
        let p = proof(&s, &nl, &nc);
        let mut forged = [0u8; ANSWER_LEN];
        forged[..32].copy_from_slice(&nc);
        forged[32..].copy_from_slice(&p);
        assert!(check_answer(&s, &nl, &forged).is_err());
    }

    #[test]
    fn a_greeting_of_another_protocol_is_refused_naming_what_was_expected() {
        let other = Protocol { magic: *b"OTHER\x00\x00\x01", listener: "another node" };
        let e = P.parse_hello(&other.hello(&[1u8; 32])).expect_err("refused");
        assert!(e.to_string().contains("not a test node"), "{e}");
    }

    #[test]
    fn secrets_parse_from_64_hex_digits_only() {
        let s = RpcSecret::random().expect("random");
        assert_eq!(RpcSecret::parse(&s.to_hex()).expect("round trip"), s);
        assert!(RpcSecret::parse("abcd").is_err());
        assert!(RpcSecret::parse(&"zz".repeat(32)).is_err());
        assert!(RpcSecret::parse(&"00".repeat(33)).is_err());
        assert_ne!(RpcSecret::random().expect("random"), RpcSecret::random().expect("random"));
        assert_eq!(format!("{s:?}"), "RpcSecret(..)", "Debug never prints the secret");
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
