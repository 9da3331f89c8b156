//! The handshake of [`super`] over an async stream: what a caller does
//! after it connects and a listener after it accepts.

use super::{ANSWER_LEN, HELLO_LEN, PROOF_LEN, Protocol, RpcAuthError, RpcSecret};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The caller's side: reads the greeting, answers, checks the listener's
/// proof. A listener that closes the connection instead of proving itself
/// has refused the caller's tag (the secrets differ).
pub async fn as_caller<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    protocol: &Protocol,
    secret: &RpcSecret,
) -> Result<(), RpcAuthError> {
    let mut hello = [0u8; HELLO_LEN];
    s.read_exact(&mut hello).await?;
    let listener_nonce = protocol.parse_hello(&hello)?;
    let caller_nonce = super::nonce()?;
    s.write_all(&super::answer(secret, &listener_nonce, &caller_nonce)).await?;
    let mut proof = [0u8; PROOF_LEN];
    s.read_exact(&mut proof).await.map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => RpcAuthError::Refused(format!(
            "{} closed the connection (is rpc_secret the same in every node's cluster file?)",
            protocol.listener
        )),
        _ => e.into(),
    })?;
    super::check_proof(secret, &caller_nonce, &listener_nonce, &proof)
}

/// The listener's side: greets, checks the caller's answer, proves itself.
pub async fn as_listener<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    protocol: &Protocol,
    secret: &RpcSecret,
) -> Result<(), RpcAuthError> {
    let listener_nonce = super::nonce()?;
    s.write_all(&protocol.hello(&listener_nonce)).await?;
    let mut answer = [0u8; ANSWER_LEN];
    s.read_exact(&mut answer).await?;
    let caller_nonce = super::check_answer(secret, &listener_nonce, &answer)?;
    s.write_all(&super::proof(secret, &caller_nonce, &listener_nonce)).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: Protocol = Protocol { magic: *b"TEST\x00\x00\x00\x01", listener: "a test node" };

    #[tokio::test]
    async fn a_caller_and_a_listener_with_one_secret_complete_the_handshake_and_others_do_not() {
        let s = RpcSecret::random().expect("random");
        let (mut a, mut b) = tokio::io::duplex(256);
        let (c, l) = tokio::join!(as_caller(&mut a, &P, &s), as_listener(&mut b, &P, &s));
        c.expect("caller");
        l.expect("listener");

        // A caller with another secret is refused by the listener, which
        // closes; the caller then learns it was refused.
        let other = RpcSecret::random().expect("random");
        let (mut a, mut b) = tokio::io::duplex(256);
        let listener = async move {
            let r = as_listener(&mut b, &P, &s).await;
            drop(b);
            r
        };
        let (c, l) = tokio::join!(as_caller(&mut a, &P, &other), listener);
        assert!(matches!(l, Err(RpcAuthError::Refused(_))), "{l:?}");
        let e = c.expect_err("refused caller");
        assert!(e.to_string().contains("rpc_secret"), "{e}");
    }
}
