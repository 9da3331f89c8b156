//! Sans-IO codec for the NBD protocol (fixed newstyle negotiation, with
//! STARTTLS and extended headers, and the transmission phase), as defined by
//! `doc/proto.md` of NetworkBlockDevice/nbd.
//!
//! Nothing in here performs I/O or knows about tokio: every function takes or
//! fills byte buffers, so the codec can be property-tested and fuzzed on its own.
//! The async NBD server above it is the only place that touches sockets.

pub mod handshake;
pub mod reply;
pub mod request;

/// `NBDMAGIC`, the first eight bytes the server sends.
pub const NBD_MAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`, sent by the server after `NBDMAGIC` and by the client before each option.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Magic that starts every option reply.
pub const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Magic of a transmission request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic of an extended (32-byte, 64-bit length) transmission request.
pub const EXTENDED_REQUEST_MAGIC: u32 = 0x21e4_1c71;
/// Magic of a simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Magic of a structured reply chunk.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;
/// Magic of an extended reply chunk (32-byte header, 64-bit length).
pub const EXTENDED_REPLY_MAGIC: u32 = 0x6e8a_278c;

/// Handshake flags sent by the server.
pub mod handshake_flags {
    pub const FIXED_NEWSTYLE: u16 = 1 << 0;
    pub const NO_ZEROES: u16 = 1 << 1;
}

/// Client flags, answered to the handshake flags.
pub mod client_flags {
    pub const FIXED_NEWSTYLE: u32 = 1 << 0;
    pub const NO_ZEROES: u32 = 1 << 1;
}

/// Transmission flags describing an export.
pub mod tx_flags {
    pub const HAS_FLAGS: u16 = 1 << 0;
    pub const READ_ONLY: u16 = 1 << 1;
    pub const SEND_FLUSH: u16 = 1 << 2;
    pub const SEND_FUA: u16 = 1 << 3;
    pub const ROTATIONAL: u16 = 1 << 4;
    pub const SEND_TRIM: u16 = 1 << 5;
    pub const SEND_WRITE_ZEROES: u16 = 1 << 6;
    pub const SEND_DF: u16 = 1 << 7;
    pub const CAN_MULTI_CONN: u16 = 1 << 8;
    pub const SEND_RESIZE: u16 = 1 << 9;
    pub const SEND_CACHE: u16 = 1 << 10;
    pub const SEND_FAST_ZERO: u16 = 1 << 11;
}

/// Option codes sent by the client during negotiation.
pub mod opt {
    pub const EXPORT_NAME: u32 = 1;
    pub const ABORT: u32 = 2;
    pub const LIST: u32 = 3;
    pub const STARTTLS: u32 = 5;
    pub const INFO: u32 = 6;
    pub const GO: u32 = 7;
    pub const STRUCTURED_REPLY: u32 = 8;
    pub const LIST_META_CONTEXT: u32 = 9;
    pub const SET_META_CONTEXT: u32 = 10;
    pub const EXTENDED_HEADERS: u32 = 11;
}

/// Option reply types.
pub mod rep {
    pub const ACK: u32 = 1;
    pub const SERVER: u32 = 2;
    pub const INFO: u32 = 3;
    pub const META_CONTEXT: u32 = 4;
    const ERR: u32 = 1 << 31;
    pub const ERR_UNSUP: u32 = ERR | 1;
    pub const ERR_POLICY: u32 = ERR | 2;
    pub const ERR_INVALID: u32 = ERR | 3;
    pub const ERR_PLATFORM: u32 = ERR | 4;
    pub const ERR_TLS_REQD: u32 = ERR | 5;
    pub const ERR_UNKNOWN: u32 = ERR | 6;
    pub const ERR_SHUTDOWN: u32 = ERR | 7;
    pub const ERR_BLOCK_SIZE_REQD: u32 = ERR | 8;
    pub const ERR_TOO_BIG: u32 = ERR | 9;
    pub const ERR_EXT_HEADER_REQD: u32 = ERR | 10;
}

/// `NBD_INFO_*` item types used by `NBD_OPT_INFO` and `NBD_OPT_GO`.
pub mod info {
    pub const EXPORT: u16 = 0;
    pub const NAME: u16 = 1;
    pub const DESCRIPTION: u16 = 2;
    pub const BLOCK_SIZE: u16 = 3;
}

/// Command types of the transmission phase.
pub mod cmd {
    pub const READ: u16 = 0;
    pub const WRITE: u16 = 1;
    pub const DISC: u16 = 2;
    pub const FLUSH: u16 = 3;
    pub const TRIM: u16 = 4;
    pub const CACHE: u16 = 5;
    pub const WRITE_ZEROES: u16 = 6;
    pub const BLOCK_STATUS: u16 = 7;
}

/// Command flags.
pub mod cmd_flags {
    pub const FUA: u16 = 1 << 0;
    pub const NO_HOLE: u16 = 1 << 1;
    pub const DF: u16 = 1 << 2;
    pub const REQ_ONE: u16 = 1 << 3;
    pub const FAST_ZERO: u16 = 1 << 4;
    /// Extended headers only: `length` bytes of payload follow the header.
    pub const PAYLOAD_LEN: u16 = 1 << 5;
}

/// Structured reply chunk types and flags.
pub mod chunk {
    pub const FLAG_DONE: u16 = 1 << 0;
    pub const NONE: u16 = 0;
    pub const OFFSET_DATA: u16 = 1;
    pub const OFFSET_HOLE: u16 = 2;
    pub const BLOCK_STATUS: u16 = 5;
    pub const BLOCK_STATUS_EXT: u16 = 6;
    pub const ERROR: u16 = (1 << 15) | 1;
    pub const ERROR_OFFSET: u16 = (1 << 15) | 2;
}

/// Status bits of the `base:allocation` metadata context.
pub mod state {
    pub const HOLE: u32 = 1 << 0;
    pub const ZERO: u32 = 1 << 1;
}

/// The one metadata context this server offers.
pub const BASE_ALLOCATION: &str = "base:allocation";
/// The context id we hand out for `base:allocation`.
pub const BASE_ALLOCATION_ID: u32 = 1;

/// Errors a server reports in a reply (NBD errno values, fixed by the protocol
/// whatever the host's errno numbering).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum NbdErrno {
    Perm = 1,
    Io = 5,
    NoMem = 12,
    Inval = 22,
    NoSpc = 28,
    Overflow = 75,
    NotSup = 95,
    Shutdown = 108,
}

impl NbdErrno {
    /// Maps a host I/O error to the NBD errno sent on the wire.
    pub fn from_io(err: &std::io::Error) -> Self {
        match err.raw_os_error() {
            Some(libc::EPERM) | Some(libc::EACCES) | Some(libc::EROFS) => NbdErrno::Perm,
            Some(libc::ENOMEM) => NbdErrno::NoMem,
            Some(libc::EINVAL) => NbdErrno::Inval,
            Some(libc::ENOSPC) | Some(libc::EDQUOT) | Some(libc::EFBIG) => NbdErrno::NoSpc,
            Some(libc::EOVERFLOW) => NbdErrno::Overflow,
            Some(libc::EOPNOTSUPP) => NbdErrno::NotSup,
            Some(libc::ESHUTDOWN) => NbdErrno::Shutdown,
            _ => NbdErrno::Io,
        }
    }

    /// Decodes a wire errno; unknown values are kept as EIO, as the spec asks
    /// clients to treat unknown errors.
    pub fn from_wire(v: u32) -> Self {
        match v {
            1 => NbdErrno::Perm,
            12 => NbdErrno::NoMem,
            22 => NbdErrno::Inval,
            28 => NbdErrno::NoSpc,
            75 => NbdErrno::Overflow,
            95 => NbdErrno::NotSup,
            108 => NbdErrno::Shutdown,
            _ => NbdErrno::Io,
        }
    }

    /// The lower-case errno name, for messages and metrics labels.
    pub fn name(self) -> &'static str {
        match self {
            NbdErrno::Perm => "EPERM",
            NbdErrno::Io => "EIO",
            NbdErrno::NoMem => "ENOMEM",
            NbdErrno::Inval => "EINVAL",
            NbdErrno::NoSpc => "ENOSPC",
            NbdErrno::Overflow => "EOVERFLOW",
            NbdErrno::NotSup => "ENOTSUP",
            NbdErrno::Shutdown => "ESHUTDOWN",
        }
    }
}

impl std::fmt::Display for NbdErrno {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A malformed message from the peer. Protocol errors are kept apart from
/// [`crate::CoronaError`]: they are about bytes on the wire, not volumes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    /// The message is shorter than its fixed part.
    #[error("message truncated: need {need} bytes, have {have}")]
    Truncated { need: usize, have: usize },
    /// A magic number did not match.
    #[error("bad magic {found:#x}, expected {expected:#x}")]
    BadMagic { expected: u64, found: u64 },
    /// A length field inside a message points past its end or breaks a limit.
    #[error("bad length: {0}")]
    BadLength(&'static str),
    /// A string was not valid UTF-8 or held a NUL.
    #[error("bad string: {0}")]
    BadString(&'static str),
    /// A reply did not make sense for the request it answers.
    #[error("unexpected reply: {0}")]
    Unexpected(String),
}

/// Longest string (export name, context name, message) accepted from a peer.
pub const MAX_STRING: usize = 4096;
/// Longest option payload accepted during negotiation.
pub const MAX_OPTION_LEN: u32 = 64 * 1024;

pub(crate) fn be_u16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}
pub(crate) fn be_u32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
pub(crate) fn be_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(a)
}

/// Reads a `u32 length` + string from `buf` at `*pos`, advancing `*pos`.
pub(crate) fn take_string(buf: &[u8], pos: &mut usize) -> Result<String, ProtoError> {
    if buf.len() < *pos + 4 {
        return Err(ProtoError::Truncated { need: *pos + 4, have: buf.len() });
    }
    let len = be_u32(buf, *pos) as usize;
    *pos += 4;
    if len > MAX_STRING {
        return Err(ProtoError::BadLength("string longer than 4096 bytes"));
    }
    if buf.len() < *pos + len {
        return Err(ProtoError::BadLength("string runs past the end of the option"));
    }
    let s = std::str::from_utf8(&buf[*pos..*pos + len]).map_err(|_| ProtoError::BadString("not UTF-8"))?;
    if s.contains('\0') {
        return Err(ProtoError::BadString("contains NUL"));
    }
    *pos += len;
    Ok(s.to_owned())
}
