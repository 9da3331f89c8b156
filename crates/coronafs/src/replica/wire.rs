//! The replica RPC's frames, sans-IO: a primary's requests (OPEN, WRITE,
//! WRITE_ZEROES, TRIM, FLUSH, SNAPSHOT, DELETE_SNAPSHOT, RESIZE, FLATTEN),
//! each numbered and tagged with the primary's epoch, and the replica's
//! in-order answers; the primary's unanswered HEARTBEAT on an idle stream;
//! a new primary's fencing VOTE with its answer
//! ([`VoteReply`]); and a primary's DELETE_VOLUME of a copy. Layout in
//! docs/design/replication-volumes.md.

use crate::error::{CoronaError, Result};
use bytes::Bytes;

/// Bytes of a request header.
pub const HEADER_LEN: usize = 40;
/// Bytes of a reply.
pub const REPLY_LEN: usize = 16;
/// Largest WRITE payload (as NBD's largest request).
pub const MAX_PAYLOAD: u64 = 32 << 20;
/// Longest volume or node name in OPEN and VOTE.
pub const MAX_NAME: u64 = 255;
/// Most copies OPEN may name.
pub const MAX_COPIES: usize = 16;
/// Largest OPEN or VOTE payload: names, each behind a length byte.
const MAX_NAMES_PAYLOAD: u64 = 8 + (MAX_COPIES as u64 + 2) * (MAX_NAME + 1) + 1 + 8;
/// Bytes of a vote answer.
pub const VOTE_REPLY_LEN: usize = 48;
const REQUEST_MAGIC: &[u8; 4] = b"CFR1";
const REPLY_MAGIC: &[u8; 4] = b"CFA1";
const VOTE_REPLY_MAGIC: &[u8; 4] = b"CFV1";
/// WRITE_ZEROES flag: the replica may free the space.
const FLAG_PUNCH: u8 = 1;

/// What a frame asks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Body {
    /// Binds the connection to a volume of this size; the frame's `seq` is
    /// the first one the replica must then expect.
    Open { volume: String, size: u64, origin: Origin },
    /// Writes `data` at `offset` (shared by every link the write goes to).
    Write { offset: u64, data: Bytes },
    /// Zeroes a range; with `punch` the space may be freed.
    WriteZeroes { offset: u64, len: u64, punch: bool },
    /// Discards a range.
    Trim { offset: u64, len: u64 },
    /// Makes every earlier frame durable.
    Flush,
    /// Asks for the copy's vote: `candidate` wants to be the primary of
    /// `volume` at the frame's epoch (the only frame of its connection).
    Vote { volume: String, candidate: String },
    /// The primary is alive: sent on an idle stream every heartbeat period.
    /// Carries `seq` 0, takes no number of the stream and gets no answer.
    Heartbeat,
    /// Freezes the copy's head as snapshot `name` of the stream's volume,
    /// at exactly this point of the stream.
    Snapshot { name: String },
    /// Deletes snapshot `name` of the stream's volume (done if it is not there).
    DeleteSnapshot { name: String },
    /// Grows the copy to `size` bytes, at exactly this point of the stream.
    Resize { size: u64 },
    /// Copies every granule the copy inherits from a snapshot into its head
    /// and detaches it (its bytes do not change; done in the background).
    Flatten,
    /// The primary `primary` deleted `volume`: the copy deletes itself
    /// (the only frame of its connection, seq 0; answered with a [`Reply`]).
    DeleteVolume { volume: String, primary: String },
}

/// Who sends a write stream: the stream's number (its start time on the
/// primary, so a later stream of the same primary and epoch is higher), the
/// primary's node name and every copy of the volume (the primary included).
/// Empty for a primary outside a cluster (tests).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Origin {
    pub stream: u64,
    pub primary: String,
    pub copies: Vec<String>,
    /// The incarnation the primary knows the opened copy by (0: none, it
    /// takes any); a copy of another incarnation refuses the OPEN (`ENXIO`).
    pub incarnation: u64,
}

fn put_name(out: &mut Vec<u8>, n: &str) {
    // Names are checked to be at most MAX_NAME bytes where they are made.
    let b = &n.as_bytes()[..n.len().min(MAX_NAME as usize)];
    out.push(b.len() as u8);
    out.extend_from_slice(b);
}

/// Reads names written by `put_name` from a peer's payload.
struct Names<'a>(&'a [u8]);

impl Names<'_> {
    fn u64(&mut self) -> Result<u64> {
        if self.0.len() < 8 {
            return Err(bad("payload too short".into()));
        }
        let v = be64(self.0);
        self.0 = &self.0[8..];
        Ok(v)
    }
    fn byte(&mut self) -> Result<u8> {
        let (&b, rest) = self.0.split_first().ok_or_else(|| bad("payload too short".into()))?;
        self.0 = rest;
        Ok(b)
    }
    fn name(&mut self) -> Result<String> {
        let n = self.byte()? as usize;
        if self.0.len() < n {
            return Err(bad("name runs past the payload".into()));
        }
        let (s, rest) = self.0.split_at(n);
        self.0 = rest;
        String::from_utf8(s.to_vec()).map_err(|_| bad("a name is not UTF-8".into()))
    }
    fn end(&self) -> Result<()> {
        if self.0.is_empty() { Ok(()) } else { Err(bad("bytes after the names".into())) }
    }
}
/// One request: its place in the volume's write stream, the primary's
/// epoch, and what it asks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Msg {
    pub seq: u64,
    pub epoch: u64,
    pub body: Body,
}

/// A decoded request header: what follows it, and how to finish the frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    kind: u8,
    flags: u8,
    pub seq: u64,
    pub epoch: u64,
    offset: u64,
    len: u64,
}

fn bad(why: String) -> CoronaError {
    CoronaError::Replica(format!("bad replica frame: {why}"))
}

impl Msg {
    /// The header and the payload that follows it (empty for most kinds).
    pub fn encode(&self) -> ([u8; HEADER_LEN], std::borrow::Cow<'_, [u8]>) {
        let mut names = Vec::new();
        match &self.body {
            Body::Open { volume, origin, .. } => {
                put_name(&mut names, volume);
                names.extend_from_slice(&origin.stream.to_be_bytes());
                put_name(&mut names, &origin.primary);
                let copies = &origin.copies[..origin.copies.len().min(MAX_COPIES)];
                names.push(copies.len() as u8);
                for c in copies {
                    put_name(&mut names, c);
                }
                names.extend_from_slice(&origin.incarnation.to_be_bytes());
            }
            Body::Vote { volume, candidate } | Body::DeleteVolume { volume, primary: candidate } => {
                put_name(&mut names, volume);
                put_name(&mut names, candidate);
            }
            Body::Snapshot { name } | Body::DeleteSnapshot { name } => put_name(&mut names, name),
            _ => {}
        }
        let (kind, flags, offset, len, payload): (u8, u8, u64, u64, &[u8]) = match &self.body {
            Body::Open { size, .. } => (0, 0, *size, names.len() as u64, &[]),
            Body::Vote { .. } => (5, 0, 0, names.len() as u64, &[]),
            Body::Write { offset, data } => (1, 0, *offset, data.len() as u64, data),
            Body::WriteZeroes { offset, len, punch } => (2, if *punch { FLAG_PUNCH } else { 0 }, *offset, *len, &[]),
            Body::Trim { offset, len } => (3, 0, *offset, *len, &[]),
            Body::Flush => (4, 0, 0, 0, &[]),
            Body::Heartbeat => (6, 0, 0, 0, &[]),
            Body::Snapshot { .. } => (8, 0, 0, names.len() as u64, &[]),
            Body::DeleteSnapshot { .. } => (9, 0, 0, names.len() as u64, &[]),
            Body::DeleteVolume { .. } => (10, 0, 0, names.len() as u64, &[]),
            Body::Resize { size } => (11, 0, *size, 0, &[]),
            Body::Flatten => (12, 0, 0, 0, &[]),
        };
        let mut h = [0u8; HEADER_LEN];
        h[..4].copy_from_slice(REQUEST_MAGIC);
        h[4] = kind;
        h[5] = flags;
        h[8..16].copy_from_slice(&self.seq.to_be_bytes());
        h[16..24].copy_from_slice(&self.epoch.to_be_bytes());
        h[24..32].copy_from_slice(&offset.to_be_bytes());
        h[32..40].copy_from_slice(&len.to_be_bytes());
        if names.is_empty() { (h, std::borrow::Cow::Borrowed(payload)) } else { (h, std::borrow::Cow::Owned(names)) }
    }
}

fn be64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}

impl Header {
    /// Checks a header from the wire: magic, kind, flags and payload limits.
    pub fn decode(h: &[u8; HEADER_LEN]) -> Result<Self> {
        if &h[..4] != REQUEST_MAGIC {
            return Err(bad("wrong magic".into()));
        }
        let hd = Header {
            kind: h[4],
            flags: h[5],
            seq: be64(&h[8..]),
            epoch: be64(&h[16..]),
            offset: be64(&h[24..]),
            len: be64(&h[32..]),
        };
        let known_flags = if hd.kind == 2 { FLAG_PUNCH } else { 0 };
        // Kind 7 was PROBE, the election's question before it stood; the
        // volume map decides takeovers now, and no frame of kind 7 is taken.
        if hd.kind > 12 || hd.kind == 7 {
            return Err(bad(format!("unknown kind {}", hd.kind)));
        }
        if hd.flags & !known_flags != 0 || h[6..8] != [0, 0] {
            return Err(bad(format!("unknown flags {:#x} for kind {}", hd.flags, hd.kind)));
        }
        match hd.kind {
            0 | 5 | 10 if hd.len == 0 || hd.len > MAX_NAMES_PAYLOAD => Err(bad(format!("names of {} bytes", hd.len))),
            5 | 10 if hd.seq != 0 || hd.offset != 0 => {
                Err(bad("vote or volume deletion with a seq or an offset".into()))
            }
            11 if hd.len != 0 || hd.offset == 0 => Err(bad("resize with a length or to 0 bytes".into())),
            12 if hd.offset != 0 || hd.len != 0 => Err(bad("flatten with a range".into())),
            6 if hd.seq != 0 || hd.offset != 0 || hd.len != 0 => Err(bad("heartbeat with a seq or a range".into())),
            8 | 9 if hd.len < 2 || hd.len > MAX_NAME + 1 || hd.offset != 0 => {
                Err(bad(format!("snapshot frame with a name of {} bytes or an offset", hd.len)))
            }
            1 if hd.len > MAX_PAYLOAD => Err(bad(format!("write of {} bytes (at most {MAX_PAYLOAD})", hd.len))),
            4 if hd.offset != 0 || hd.len != 0 => Err(bad("flush with a range".into())),
            _ => Ok(hd),
        }
    }

    /// Bytes of payload that follow this header.
    pub fn payload_len(&self) -> usize {
        match self.kind {
            0 | 1 | 5 | 7 | 8 | 9 | 10 => self.len as usize,
            _ => 0,
        }
    }

    /// The request, given the payload (`payload_len` bytes) that followed.
    pub fn finish(self, payload: Vec<u8>) -> Result<Msg> {
        if payload.len() != self.payload_len() {
            return Err(bad(format!("payload of {} bytes, header says {}", payload.len(), self.payload_len())));
        }
        let body = match self.kind {
            0 => {
                let mut r = Names(&payload);
                let volume = r.name()?;
                let stream = r.u64()?;
                let primary = r.name()?;
                let n = r.byte()? as usize;
                if n > MAX_COPIES {
                    return Err(bad(format!("{n} copies (at most {MAX_COPIES})")));
                }
                let copies = (0..n).map(|_| r.name()).collect::<Result<Vec<_>>>()?;
                let incarnation = r.u64()?;
                r.end()?;
                if volume.is_empty() {
                    return Err(bad("empty volume name".into()));
                }
                Body::Open { volume, size: self.offset, origin: Origin { stream, primary, copies, incarnation } }
            }
            5 | 10 => {
                let mut r = Names(&payload);
                let (volume, candidate) = (r.name()?, r.name()?);
                r.end()?;
                match self.kind {
                    5 => Body::Vote { volume, candidate },
                    _ => Body::DeleteVolume { volume, primary: candidate },
                }
            }
            11 => Body::Resize { size: self.offset },
            12 => Body::Flatten,
            8 | 9 => {
                let mut r = Names(&payload);
                let name = r.name()?;
                r.end()?;
                if name.is_empty() {
                    return Err(bad("empty snapshot name".into()));
                }
                if self.kind == 8 { Body::Snapshot { name } } else { Body::DeleteSnapshot { name } }
            }
            6 => Body::Heartbeat,
            1 => Body::Write { offset: self.offset, data: Bytes::from(payload) },
            2 => Body::WriteZeroes { offset: self.offset, len: self.len, punch: self.flags & FLAG_PUNCH != 0 },
            3 => Body::Trim { offset: self.offset, len: self.len },
            _ => Body::Flush,
        };
        Ok(Msg { seq: self.seq, epoch: self.epoch, body })
    }
}

/// A replica's answer to the request numbered `seq`: 0 or a host errno.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reply {
    pub seq: u64,
    pub errno: u32,
}

impl Reply {
    pub fn encode(&self) -> [u8; REPLY_LEN] {
        let mut r = [0u8; REPLY_LEN];
        r[..4].copy_from_slice(REPLY_MAGIC);
        r[4..8].copy_from_slice(&self.errno.to_be_bytes());
        r[8..].copy_from_slice(&self.seq.to_be_bytes());
        r
    }

    pub fn decode(r: &[u8; REPLY_LEN]) -> Result<Self> {
        if &r[..4] != REPLY_MAGIC {
            return Err(bad("wrong reply magic".into()));
        }
        Ok(Reply { errno: u32::from_be_bytes([r[4], r[5], r[6], r[7]]), seq: be64(&r[8..]) })
    }
}

/// Where a copy is in its volume's write stream: the epoch and stream it
/// last applied frames of, and the last `seq` applied. Compared in that
/// order: within one stream, equal positions mean identical bytes (frames
/// are applied strictly in `seq` order); a later stream or epoch was opened
/// by a primary that held every write of the earlier ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Position {
    pub epoch: u64,
    pub stream: u64,
    pub seq: u64,
}

/// A copy's answer to VOTE. `errno` 0 grants the vote; otherwise it is
/// refused (`EPERM`: already voted at this epoch or a later one). `epoch` is
/// the copy's epoch after answering; `position` where it is in the write
/// stream, `None` when it does not know (it restarted since its last stream).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VoteReply {
    pub errno: u32,
    pub epoch: u64,
    pub position: Option<Position>,
}

impl VoteReply {
    pub fn encode(&self) -> [u8; VOTE_REPLY_LEN] {
        let mut r = [0u8; VOTE_REPLY_LEN];
        r[..4].copy_from_slice(VOTE_REPLY_MAGIC);
        r[4..8].copy_from_slice(&self.errno.to_be_bytes());
        r[8..16].copy_from_slice(&self.epoch.to_be_bytes());
        if let Some(p) = self.position {
            r[16] = 1;
            r[24..32].copy_from_slice(&p.epoch.to_be_bytes());
            r[32..40].copy_from_slice(&p.stream.to_be_bytes());
            r[40..48].copy_from_slice(&p.seq.to_be_bytes());
        }
        r
    }

    pub fn decode(r: &[u8; VOTE_REPLY_LEN]) -> Result<Self> {
        if &r[..4] != VOTE_REPLY_MAGIC || r[16] > 1 || r[17..24] != [0; 7] {
            return Err(bad("malformed vote answer".into()));
        }
        let position =
            (r[16] == 1).then(|| Position { epoch: be64(&r[24..]), stream: be64(&r[32..]), seq: be64(&r[40..]) });
        Ok(VoteReply { errno: u32::from_be_bytes([r[4], r[5], r[6], r[7]]), epoch: be64(&r[8..]), position })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn round_trip(m: &Msg) -> Msg {
        let (h, payload) = m.encode();
        Header::decode(&h).expect("header").finish(payload.to_vec()).expect("frame")
    }

    fn body() -> impl Strategy<Value = Body> {
        prop_oneof![
            (
                "[a-z]{1,20}",
                any::<u64>(),
                any::<u64>(),
                "[a-z0-9]{0,8}",
                proptest::collection::vec("[a-z0-9]{0,8}", 0..5),
                any::<u64>()
            )
                .prop_map(|(volume, size, stream, primary, copies, incarnation)| Body::Open {
                    volume,
                    size,
                    origin: Origin { stream, primary, copies, incarnation }
                }),
            ("[a-z]{1,20}", "[a-z0-9]{0,8}").prop_map(|(volume, candidate)| Body::Vote { volume, candidate }),
            Just(Body::Heartbeat),
            (any::<u64>(), proptest::collection::vec(any::<u8>(), 0..300))
                .prop_map(|(offset, d)| Body::Write { offset, data: Bytes::from(d) }),
            (any::<u64>(), any::<u64>(), any::<bool>()).prop_map(|(offset, len, punch)| Body::WriteZeroes {
                offset,
                len,
                punch
            }),
            (any::<u64>(), any::<u64>()).prop_map(|(offset, len)| Body::Trim { offset, len }),
            Just(Body::Flush),
            "[a-z0-9]{1,40}".prop_map(|name| Body::Snapshot { name }),
            "[a-z0-9]{1,40}".prop_map(|name| Body::DeleteSnapshot { name }),
            (1..u64::MAX).prop_map(|size| Body::Resize { size }),
            Just(Body::Flatten),
            ("[a-z]{1,20}", "[a-z0-9]{0,8}").prop_map(|(volume, primary)| Body::DeleteVolume { volume, primary }),
        ]
    }

    proptest! {
        #[test]
        fn every_frame_decodes_to_what_was_encoded(seq in any::<u64>(), epoch in any::<u64>(), body in body()) {
            let seq = if matches!(
                body,
                Body::Vote { .. } | Body::Heartbeat | Body::DeleteVolume { .. }
            ) { 0 } else { seq };
            let m = Msg { seq, epoch, body };
            prop_assert_eq!(round_trip(&m), m);
        }

        #[test]
        fn every_reply_decodes_to_what_was_encoded(seq in any::<u64>(), errno in any::<u32>()) {
            let r = Reply { seq, errno };
            prop_assert_eq!(Reply::decode(&r.encode()).expect("reply"), r);
        }

        #[test]
        fn every_vote_answer_decodes_to_what_was_encoded(
            errno in any::<u32>(), epoch in any::<u64>(), p in proptest::option::of(any::<(u64, u64, u64)>())
        ) {
            let r = VoteReply { errno, epoch, position: p.map(|(epoch, stream, seq)| Position { epoch, stream, seq }) };
            prop_assert_eq!(VoteReply::decode(&r.encode()).expect("vote answer"), r);
        }

        #[test]
        fn arbitrary_payloads_of_open_vote_and_the_retired_probe_never_panic(kind in prop_oneof![Just(0u8), Just(5u8), Just(7u8), Just(8u8), Just(9u8), Just(10u8)], payload in proptest::collection::vec(any::<u8>(), 1..600)) {
            let (mut h, _) = Msg { seq: 0, epoch: 0, body: Body::Flush }.encode();
            h[4] = kind;
            h[32..40].copy_from_slice(&(payload.len() as u64).to_be_bytes());
            if let Ok(hd) = Header::decode(&h) {
                let _ = hd.finish(payload);
            }
        }

        #[test]
        fn arbitrary_headers_never_panic(h in proptest::array::uniform32(any::<u8>()), tail in any::<u64>()) {
            let mut full = [0u8; HEADER_LEN];
            full[..32].copy_from_slice(&h);
            full[32..].copy_from_slice(&tail.to_be_bytes());
            if let Ok(hd) = Header::decode(&full) {
                prop_assert!(hd.payload_len() as u64 <= MAX_PAYLOAD);
            }
        }
    }

    #[test]
    fn oversized_writes_unknown_kinds_and_wrong_magic_are_refused() {
        let (mut h, _) = Msg { seq: 1, epoch: 0, body: Body::Flush }.encode();
        h[4] = 13;
        assert!(Header::decode(&h).expect_err("kind").to_string().contains("unknown kind 13"));
        let (mut h, _) = Msg { seq: 5, epoch: 0, body: Body::Resize { size: 1 << 20 } }.encode();
        h[24..32].copy_from_slice(&0u64.to_be_bytes());
        assert!(Header::decode(&h).is_err(), "a resize to 0 bytes");
        let (mut h, _) =
            Msg { seq: 0, epoch: 2, body: Body::DeleteVolume { volume: "v".into(), primary: "n1".into() } }.encode();
        h[8..16].copy_from_slice(&1u64.to_be_bytes());
        assert!(Header::decode(&h).is_err(), "a volume deletion carries no seq");
        let (mut h, _) = Msg { seq: 0, epoch: 1, body: Body::Heartbeat }.encode();
        h[8..16].copy_from_slice(&3u64.to_be_bytes());
        assert!(Header::decode(&h).is_err(), "a heartbeat takes no number of the stream");
        let (mut h, _) =
            Msg { seq: 0, epoch: 3, body: Body::Vote { volume: "v".into(), candidate: "n2".into() } }.encode();
        h[8..16].copy_from_slice(&7u64.to_be_bytes());
        assert!(Header::decode(&h).is_err(), "a vote carries no seq");
        let (mut h, _) = Msg { seq: 1, epoch: 0, body: Body::Write { offset: 0, data: Bytes::from(vec![1]) } }.encode();
        h[32..40].copy_from_slice(&(MAX_PAYLOAD + 1).to_be_bytes());
        assert!(Header::decode(&h).expect_err("size").to_string().contains("at most"));
        h[0] = b'X';
        assert!(Header::decode(&h).is_err());
        let (mut h, _) = Msg { seq: 1, epoch: 0, body: Body::Trim { offset: 0, len: 1 } }.encode();
        h[5] = FLAG_PUNCH;
        assert!(Header::decode(&h).is_err(), "punch only on WRITE_ZEROES");
        let hd = Header::decode(&Msg { seq: 1, epoch: 0, body: Body::Flush }.encode().0).expect("flush");
        assert!(hd.finish(vec![1]).is_err(), "a payload the header does not announce");
        let (mut h, _) = Msg { seq: 4, epoch: 0, body: Body::Snapshot { name: "s1".into() } }.encode();
        h[24..32].copy_from_slice(&1u64.to_be_bytes());
        assert!(Header::decode(&h).is_err(), "a snapshot frame has no offset");
        let (h, _) = Msg { seq: 4, epoch: 0, body: Body::DeleteSnapshot { name: "s1".into() } }.encode();
        let hd = Header::decode(&h).expect("delete snapshot");
        assert!(hd.finish(vec![1, b's']).is_err(), "a payload shorter than the header says");
        assert!(hd.finish(vec![0, b's', b'1']).is_err(), "an empty name, then stray bytes");
    }
}
