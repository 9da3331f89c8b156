//! Transmission-phase replies: simple replies, structured reply chunks and
//! extended reply chunks (the 32-byte header of `NBD_OPT_EXTENDED_HEADERS`,
//! which also echoes the request's offset).
//!
//! Headers are encoded into fixed arrays so the server can send a header and
//! a pooled data buffer with one vectored write, without copying the data.

use super::*;

/// Size of a simple reply header.
pub const SIMPLE_LEN: usize = 16;
/// Size of a structured reply chunk header.
pub const CHUNK_LEN: usize = 20;
/// Size of the header in front of `OFFSET_DATA` payload (chunk header + offset).
pub const DATA_CHUNK_LEN: usize = CHUNK_LEN + 8;
/// Size of an extended reply chunk header.
pub const EXT_CHUNK_LEN: usize = 32;
/// Size of the header in front of extended `OFFSET_DATA` payload.
pub const EXT_DATA_CHUNK_LEN: usize = EXT_CHUNK_LEN + 8;

/// The replies a connection uses, as negotiated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyMode {
    /// Simple replies only (nothing negotiated).
    Simple,
    /// `NBD_OPT_STRUCTURED_REPLY`: READs and errors as structured chunks.
    Structured,
    /// `NBD_OPT_EXTENDED_HEADERS`: every reply an extended chunk, requests
    /// in 32-byte headers with 64-bit lengths.
    Extended,
}

/// A reply header of up to 40 bytes, kept inline.
#[derive(Debug, Clone, Copy)]
pub struct Head {
    buf: [u8; EXT_DATA_CHUNK_LEN],
    len: u8,
}

impl Head {
    #[inline]
    pub fn as_bytes(&self) -> &[u8] {
        &self.buf[..self.len as usize]
    }
}

/// A zero-length header, for replies whose bytes are all in a tail buffer.
#[inline]
pub fn empty() -> Head {
    Head { buf: [0u8; EXT_DATA_CHUNK_LEN], len: 0 }
}

/// A simple reply header (`error` 0 for success).
#[inline]
pub fn simple(cookie: u64, error: u32) -> Head {
    let mut buf = [0u8; EXT_DATA_CHUNK_LEN];
    buf[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    buf[4..8].copy_from_slice(&error.to_be_bytes());
    buf[8..16].copy_from_slice(&cookie.to_be_bytes());
    Head { buf, len: SIMPLE_LEN as u8 }
}

/// A structured chunk header with a payload of `len` bytes.
#[inline]
pub fn chunk(cookie: u64, flags: u16, ty: u16, len: u32) -> Head {
    let mut buf = [0u8; EXT_DATA_CHUNK_LEN];
    write_chunk(&mut buf, cookie, flags, ty, len);
    Head { buf, len: CHUNK_LEN as u8 }
}

/// An extended chunk header answering a request at `offset`, with a
/// payload of `len` bytes.
#[inline]
pub fn ext_chunk(cookie: u64, flags: u16, ty: u16, offset: u64, len: u64) -> Head {
    let mut buf = [0u8; EXT_DATA_CHUNK_LEN];
    write_ext_chunk(&mut buf, cookie, flags, ty, offset, len);
    Head { buf, len: EXT_CHUNK_LEN as u8 }
}

fn write_ext_chunk(buf: &mut [u8], cookie: u64, flags: u16, ty: u16, offset: u64, len: u64) {
    buf[0..4].copy_from_slice(&EXTENDED_REPLY_MAGIC.to_be_bytes());
    buf[4..6].copy_from_slice(&flags.to_be_bytes());
    buf[6..8].copy_from_slice(&ty.to_be_bytes());
    buf[8..16].copy_from_slice(&cookie.to_be_bytes());
    buf[16..24].copy_from_slice(&offset.to_be_bytes());
    buf[24..32].copy_from_slice(&len.to_be_bytes());
}

/// The header of a complete reply without payload to a request at
/// `offset`: a simple reply with `error` 0, or with extended headers (which
/// allow no simple replies) a final `NONE` chunk.
#[inline]
pub fn done_head(cookie: u64, mode: ReplyMode, offset: u64) -> Head {
    match mode {
        ReplyMode::Extended => ext_chunk(cookie, chunk::FLAG_DONE, chunk::NONE, offset, 0),
        _ => simple(cookie, 0),
    }
}

fn write_chunk(buf: &mut [u8], cookie: u64, flags: u16, ty: u16, len: u32) {
    buf[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    buf[4..6].copy_from_slice(&flags.to_be_bytes());
    buf[6..8].copy_from_slice(&ty.to_be_bytes());
    buf[8..16].copy_from_slice(&cookie.to_be_bytes());
    buf[16..20].copy_from_slice(&len.to_be_bytes());
}

/// The header of an `OFFSET_DATA` chunk carrying `data_len` bytes read at `offset`.
#[inline]
pub fn data_chunk(cookie: u64, done: bool, offset: u64, data_len: u32) -> Head {
    let mut buf = [0u8; EXT_DATA_CHUNK_LEN];
    let flags = if done { chunk::FLAG_DONE } else { 0 };
    write_chunk(&mut buf, cookie, flags, chunk::OFFSET_DATA, data_len + 8);
    buf[20..28].copy_from_slice(&offset.to_be_bytes());
    Head { buf, len: DATA_CHUNK_LEN as u8 }
}

/// The header of an extended final `OFFSET_DATA` chunk carrying `data_len`
/// bytes read at `offset` (the request's offset too: the data is never split).
#[inline]
pub fn ext_data_chunk(cookie: u64, offset: u64, data_len: u32) -> Head {
    let mut buf = [0u8; EXT_DATA_CHUNK_LEN];
    write_ext_chunk(&mut buf, cookie, chunk::FLAG_DONE, chunk::OFFSET_DATA, offset, data_len as u64 + 8);
    buf[32..40].copy_from_slice(&offset.to_be_bytes());
    Head { buf, len: EXT_DATA_CHUNK_LEN as u8 }
}

/// The header of a successful READ reply carrying `len` bytes read at
/// `offset`: a simple reply, or with structured replies or extended headers
/// a final `OFFSET_DATA` chunk. An `OFFSET_DATA` chunk must carry at least
/// one byte, so a zero-length READ gets a final `NONE` chunk instead.
#[inline]
pub fn read_head(cookie: u64, mode: ReplyMode, offset: u64, len: u32) -> Head {
    match (mode, len) {
        (ReplyMode::Simple, _) => simple(cookie, 0),
        (ReplyMode::Structured, 0) => chunk(cookie, chunk::FLAG_DONE, chunk::NONE, 0),
        (ReplyMode::Structured, _) => data_chunk(cookie, true, offset, len),
        (ReplyMode::Extended, 0) => ext_chunk(cookie, chunk::FLAG_DONE, chunk::NONE, offset, 0),
        (ReplyMode::Extended, _) => ext_data_chunk(cookie, offset, len),
    }
}

/// A complete `OFFSET_HOLE` chunk.
pub fn hole_chunk(cookie: u64, done: bool, offset: u64, len: u32, out: &mut Vec<u8>) {
    let flags = if done { chunk::FLAG_DONE } else { 0 };
    let mut h = [0u8; CHUNK_LEN];
    write_chunk(&mut h, cookie, flags, chunk::OFFSET_HOLE, 12);
    out.extend_from_slice(&h);
    out.extend_from_slice(&offset.to_be_bytes());
    out.extend_from_slice(&len.to_be_bytes());
}

/// A complete final `ERROR` chunk with a message.
pub fn error_chunk(cookie: u64, errno: NbdErrno, msg: &str, out: &mut Vec<u8>) {
    let msg = &msg.as_bytes()[..msg.len().min(MAX_STRING)];
    let mut h = [0u8; CHUNK_LEN];
    write_chunk(&mut h, cookie, chunk::FLAG_DONE, chunk::ERROR, 6 + msg.len() as u32);
    out.extend_from_slice(&h);
    error_payload(errno, msg, out);
}

/// A complete final extended `ERROR` chunk answering a request at `offset`.
pub fn ext_error_chunk(cookie: u64, offset: u64, errno: NbdErrno, msg: &str, out: &mut Vec<u8>) {
    let msg = &msg.as_bytes()[..msg.len().min(MAX_STRING)];
    let mut h = [0u8; EXT_CHUNK_LEN];
    write_ext_chunk(&mut h, cookie, chunk::FLAG_DONE, chunk::ERROR, offset, 6 + msg.len() as u64);
    out.extend_from_slice(&h);
    error_payload(errno, msg, out);
}

fn error_payload(errno: NbdErrno, msg: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&(errno as u32).to_be_bytes());
    out.extend_from_slice(&(msg.len() as u16).to_be_bytes());
    out.extend_from_slice(msg);
}

/// A block-status extent: `length` bytes with `flags` of `base:allocation`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub length: u32,
    pub flags: u32,
}

/// A complete final `BLOCK_STATUS` chunk for one context.
pub fn block_status_chunk(cookie: u64, context: u32, extents: &[Extent], out: &mut Vec<u8>) {
    let mut h = [0u8; CHUNK_LEN];
    write_chunk(&mut h, cookie, chunk::FLAG_DONE, chunk::BLOCK_STATUS, 4 + 8 * extents.len() as u32);
    out.extend_from_slice(&h);
    out.extend_from_slice(&context.to_be_bytes());
    for e in extents {
        out.extend_from_slice(&e.length.to_be_bytes());
        out.extend_from_slice(&e.flags.to_be_bytes());
    }
}

/// One extent of an extended block-status reply (`BLOCK_STATUS_EXT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExtentExt {
    pub length: u64,
    pub flags: u64,
}

/// A complete final `BLOCK_STATUS_EXT` chunk for one context, answering a
/// request at `offset` (extended headers only).
pub fn ext_block_status_chunk(cookie: u64, offset: u64, context: u32, extents: &[ExtentExt], out: &mut Vec<u8>) {
    let mut h = [0u8; EXT_CHUNK_LEN];
    let len = 8 + 16 * extents.len() as u64;
    write_ext_chunk(&mut h, cookie, chunk::FLAG_DONE, chunk::BLOCK_STATUS_EXT, offset, len);
    out.extend_from_slice(&h);
    out.extend_from_slice(&context.to_be_bytes());
    out.extend_from_slice(&(extents.len() as u32).to_be_bytes());
    for e in extents {
        out.extend_from_slice(&e.length.to_be_bytes());
        out.extend_from_slice(&e.flags.to_be_bytes());
    }
}

/// A reply header as a client decodes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyHeader {
    /// A simple reply; `READ` data (if no error) follows.
    Simple { cookie: u64, error: u32 },
    /// A structured chunk; `length` bytes of payload follow.
    Chunk { cookie: u64, flags: u16, ty: u16, length: u32 },
    /// An extended chunk answering the request at `offset`; `length` bytes
    /// of payload follow.
    Extended { cookie: u64, flags: u16, ty: u16, offset: u64, length: u64 },
}

impl ReplyHeader {
    /// Bytes a client needs to read for the header that starts with `magic`.
    pub fn header_len(magic: u32) -> Result<usize, ProtoError> {
        match magic {
            SIMPLE_REPLY_MAGIC => Ok(SIMPLE_LEN),
            STRUCTURED_REPLY_MAGIC => Ok(CHUNK_LEN),
            EXTENDED_REPLY_MAGIC => Ok(EXT_CHUNK_LEN),
            other => Err(ProtoError::BadMagic { expected: SIMPLE_REPLY_MAGIC as u64, found: other as u64 }),
        }
    }

    /// Decodes a full header (16, 20 or 32 bytes, as [`Self::header_len`] said).
    pub fn decode(b: &[u8]) -> Result<Self, ProtoError> {
        if b.len() < 4 {
            return Err(ProtoError::Truncated { need: 4, have: b.len() });
        }
        let need = Self::header_len(be_u32(b, 0))?;
        if b.len() < need {
            return Err(ProtoError::Truncated { need, have: b.len() });
        }
        Ok(match need {
            SIMPLE_LEN => ReplyHeader::Simple { error: be_u32(b, 4), cookie: be_u64(b, 8) },
            CHUNK_LEN => ReplyHeader::Chunk {
                flags: be_u16(b, 4),
                ty: be_u16(b, 6),
                cookie: be_u64(b, 8),
                length: be_u32(b, 16),
            },
            _ => ReplyHeader::Extended {
                flags: be_u16(b, 4),
                ty: be_u16(b, 6),
                cookie: be_u64(b, 8),
                offset: be_u64(b, 16),
                length: be_u64(b, 24),
            },
        })
    }

    pub fn cookie(&self) -> u64 {
        match *self {
            ReplyHeader::Simple { cookie, .. }
            | ReplyHeader::Chunk { cookie, .. }
            | ReplyHeader::Extended { cookie, .. } => cookie,
        }
    }
}

/// Decodes an error chunk payload into (errno, message).
pub fn decode_error_payload(p: &[u8]) -> Result<(u32, String), ProtoError> {
    if p.len() < 6 {
        return Err(ProtoError::Truncated { need: 6, have: p.len() });
    }
    let n = be_u16(p, 4) as usize;
    if 6 + n > p.len() {
        return Err(ProtoError::BadLength("error message runs past the chunk"));
    }
    Ok((be_u32(p, 0), String::from_utf8_lossy(&p[6..6 + n]).into_owned()))
}

/// Decodes a `BLOCK_STATUS` payload into (context id, extents).
pub fn decode_block_status(p: &[u8]) -> Result<(u32, Vec<Extent>), ProtoError> {
    if p.len() < 12 || !(p.len() - 4).is_multiple_of(8) {
        return Err(ProtoError::BadLength("block status payload is not 4 + 8n bytes"));
    }
    let extents = p[4..].chunks_exact(8).map(|c| Extent { length: be_u32(c, 0), flags: be_u32(c, 4) }).collect();
    Ok((be_u32(p, 0), extents))
}

/// Decodes a `BLOCK_STATUS_EXT` payload into (context id, extents); a
/// nonzero descriptor count must match the payload.
pub fn decode_block_status_ext(p: &[u8]) -> Result<(u32, Vec<ExtentExt>), ProtoError> {
    if p.len() < 24 || !(p.len() - 8).is_multiple_of(16) {
        return Err(ProtoError::BadLength("extended block status payload is not 8 + 16n bytes"));
    }
    let count = be_u32(p, 4) as usize;
    if count != 0 && count != (p.len() - 8) / 16 {
        return Err(ProtoError::BadLength("descriptor count does not match the payload"));
    }
    let extents = p[8..].chunks_exact(16).map(|c| ExtentExt { length: be_u64(c, 0), flags: be_u64(c, 8) }).collect();
    Ok((be_u32(p, 0), extents))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_zero_length_read_is_answered_without_a_data_chunk() {
        // The spec requires an OFFSET_DATA chunk to carry at least one byte
        // (length >= 9); libnbd drops the connection on a shorter one.
        let h = read_head(7, ReplyMode::Structured, 4096, 0);
        let d = ReplyHeader::decode(h.as_bytes()).unwrap();
        assert_eq!(d, ReplyHeader::Chunk { cookie: 7, flags: chunk::FLAG_DONE, ty: chunk::NONE, length: 0 });
        assert_eq!(h.as_bytes().len(), CHUNK_LEN, "nothing follows a NONE chunk");
        let h = read_head(7, ReplyMode::Simple, 4096, 0);
        assert_eq!(ReplyHeader::decode(h.as_bytes()).unwrap(), ReplyHeader::Simple { cookie: 7, error: 0 });
        let h = read_head(7, ReplyMode::Extended, 4096, 0);
        let d = ReplyHeader::decode(h.as_bytes()).expect("decodes");
        let none =
            ReplyHeader::Extended { cookie: 7, flags: chunk::FLAG_DONE, ty: chunk::NONE, offset: 4096, length: 0 };
        assert_eq!(d, none);
        assert_eq!(h.as_bytes().len(), EXT_CHUNK_LEN);
    }

    #[test]
    fn extended_headers_never_get_a_simple_reply() {
        // Success without payload is a final NONE chunk echoing the offset.
        let d = ReplyHeader::decode(done_head(9, ReplyMode::Extended, 1 << 40).as_bytes()).expect("decodes");
        let none =
            ReplyHeader::Extended { cookie: 9, flags: chunk::FLAG_DONE, ty: chunk::NONE, offset: 1 << 40, length: 0 };
        assert_eq!(d, none);
        for mode in [ReplyMode::Simple, ReplyMode::Structured] {
            let d = ReplyHeader::decode(done_head(9, mode, 1 << 40).as_bytes()).expect("decodes");
            assert_eq!(d, ReplyHeader::Simple { cookie: 9, error: 0 });
        }
    }

    proptest! {
        #[test]
        fn read_head_of_data_is_one_final_data_chunk(cookie: u64, offset: u64, len in 1u32..(1 << 25)) {
            let d = ReplyHeader::decode(read_head(cookie, ReplyMode::Structured, offset, len).as_bytes()).expect("decodes");
            prop_assert_eq!(d, ReplyHeader::Chunk { cookie, flags: chunk::FLAG_DONE, ty: chunk::OFFSET_DATA, length: len + 8 });
            let h = read_head(cookie, ReplyMode::Extended, offset, len);
            let d = ReplyHeader::decode(h.as_bytes()).expect("decodes");
            let length = len as u64 + 8;
            prop_assert_eq!(d, ReplyHeader::Extended { cookie, flags: chunk::FLAG_DONE, ty: chunk::OFFSET_DATA, offset, length });
            prop_assert_eq!(h.as_bytes().len(), EXT_DATA_CHUNK_LEN);
            prop_assert_eq!(be_u64(h.as_bytes(), EXT_CHUNK_LEN), offset, "the data's offset follows the header");
        }

        #[test]
        fn ext_chunk_roundtrips(cookie: u64, flags: u16, ty: u16, offset: u64, length: u64) {
            let d = ReplyHeader::decode(ext_chunk(cookie, flags, ty, offset, length).as_bytes()).expect("decodes");
            prop_assert_eq!(d, ReplyHeader::Extended { cookie, flags, ty, offset, length });
            prop_assert_eq!(d.cookie(), cookie);
        }

        #[test]
        fn ext_block_status_roundtrips(cookie: u64, offset: u64, ctx: u32, ext in prop::collection::vec((1u64.., any::<u32>()), 1..20)) {
            let ext: Vec<ExtentExt> = ext.into_iter().map(|(length, flags)| ExtentExt { length, flags: flags as u64 }).collect();
            let mut out = Vec::new();
            ext_block_status_chunk(cookie, offset, ctx, &ext, &mut out);
            let ReplyHeader::Extended { length, ty, offset: o, .. } = ReplyHeader::decode(&out).expect("decodes") else { panic!() };
            prop_assert_eq!((length as usize, ty, o), (out.len() - EXT_CHUNK_LEN, chunk::BLOCK_STATUS_EXT, offset));
            prop_assert_eq!(decode_block_status_ext(&out[EXT_CHUNK_LEN..]).expect("decodes"), (ctx, ext));
        }

        #[test]
        fn ext_error_chunk_roundtrips(cookie: u64, offset: u64, msg in ".{0,100}") {
            let mut out = Vec::new();
            ext_error_chunk(cookie, offset, NbdErrno::Overflow, &msg, &mut out);
            let ReplyHeader::Extended { length, ty, flags, .. } = ReplyHeader::decode(&out).expect("decodes") else { panic!() };
            prop_assert_eq!((length as usize, ty, flags), (out.len() - EXT_CHUNK_LEN, chunk::ERROR, chunk::FLAG_DONE));
            prop_assert_eq!(decode_error_payload(&out[EXT_CHUNK_LEN..]).expect("decodes"), (75, msg));
        }

        #[test]
        fn simple_header_roundtrips(cookie: u64, error: u32) {
            let h = simple(cookie, error);
            prop_assert_eq!(ReplyHeader::decode(h.as_bytes()).unwrap(), ReplyHeader::Simple { cookie, error });
        }

        #[test]
        fn data_chunk_roundtrips(cookie: u64, done: bool, offset: u64, len in 1u32..(1 << 25)) {
            let h = data_chunk(cookie, done, offset, len);
            let d = ReplyHeader::decode(h.as_bytes()).unwrap();
            let flags = if done { chunk::FLAG_DONE } else { 0 };
            prop_assert_eq!(d, ReplyHeader::Chunk { cookie, flags, ty: chunk::OFFSET_DATA, length: len + 8 });
            prop_assert_eq!(be_u64(h.as_bytes(), 20), offset);
        }

        #[test]
        fn block_status_roundtrips(cookie: u64, ctx: u32, ext in prop::collection::vec((1u32.., any::<u32>()), 1..20)) {
            let ext: Vec<Extent> = ext.into_iter().map(|(length, flags)| Extent { length, flags }).collect();
            let mut out = Vec::new();
            block_status_chunk(cookie, ctx, &ext, &mut out);
            let ReplyHeader::Chunk { length, .. } = ReplyHeader::decode(&out).unwrap() else { panic!() };
            prop_assert_eq!(length as usize, out.len() - CHUNK_LEN);
            prop_assert_eq!(decode_block_status(&out[CHUNK_LEN..]).unwrap(), (ctx, ext));
        }

        #[test]
        fn error_chunk_roundtrips(cookie: u64, msg in ".{0,100}") {
            let mut out = Vec::new();
            error_chunk(cookie, NbdErrno::Inval, &msg, &mut out);
            prop_assert_eq!(decode_error_payload(&out[CHUNK_LEN..]).unwrap(), (22, msg));
        }

        #[test]
        fn any_reply_bytes_decode_or_error(b in prop::collection::vec(any::<u8>(), 0..40)) {
            let _ = ReplyHeader::decode(&b);
            let _ = decode_error_payload(&b);
            let _ = decode_block_status(&b);
            let _ = decode_block_status_ext(&b);
        }
    }
}
