//! Transmission-phase requests: the compact 28-byte header, the extended
//! 32-byte one (64-bit length, negotiated with `NBD_OPT_EXTENDED_HEADERS`),
//! and the checks that need nothing but the header and the export's geometry.

use super::*;

/// Size of a compact request header.
pub const REQUEST_LEN: usize = 28;
/// Size of an extended request header.
pub const EXT_REQUEST_LEN: usize = 32;

/// The command of a request. Unknown commands are kept so the server can
/// answer them with `EINVAL` instead of dropping the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Read,
    Write,
    Disc,
    Flush,
    Trim,
    Cache,
    WriteZeroes,
    BlockStatus,
    Unknown(u16),
}

impl Command {
    pub fn from_wire(v: u16) -> Self {
        match v {
            cmd::READ => Command::Read,
            cmd::WRITE => Command::Write,
            cmd::DISC => Command::Disc,
            cmd::FLUSH => Command::Flush,
            cmd::TRIM => Command::Trim,
            cmd::CACHE => Command::Cache,
            cmd::WRITE_ZEROES => Command::WriteZeroes,
            cmd::BLOCK_STATUS => Command::BlockStatus,
            other => Command::Unknown(other),
        }
    }

    pub fn to_wire(self) -> u16 {
        match self {
            Command::Read => cmd::READ,
            Command::Write => cmd::WRITE,
            Command::Disc => cmd::DISC,
            Command::Flush => cmd::FLUSH,
            Command::Trim => cmd::TRIM,
            Command::Cache => cmd::CACHE,
            Command::WriteZeroes => cmd::WRITE_ZEROES,
            Command::BlockStatus => cmd::BLOCK_STATUS,
            Command::Unknown(v) => v,
        }
    }

    /// A short lower-case name, used for metrics labels and logs.
    pub fn name(self) -> &'static str {
        match self {
            Command::Read => "read",
            Command::Write => "write",
            Command::Disc => "disc",
            Command::Flush => "flush",
            Command::Trim => "trim",
            Command::Cache => "cache",
            Command::WriteZeroes => "write_zeroes",
            Command::BlockStatus => "block_status",
            Command::Unknown(_) => "unknown",
        }
    }
}

/// A decoded request header, compact or extended.
///
/// Whether a payload follows depends on the header style negotiated (see
/// [`Request::payload_len`]): a WRITE always carries one; with extended
/// headers any other command may announce one with
/// `NBD_CMD_FLAG_PAYLOAD_LEN`, which stays in `flags` so that
/// [`Request::validate`] refuses it (no command here takes a payload but
/// WRITE). A WRITE's own `PAYLOAD_LEN` is taken out when decoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub flags: u16,
    pub command: Command,
    pub cookie: u64,
    pub offset: u64,
    /// The effect length, or the payload's length. Compact headers carry
    /// 32 bits of it, extended headers 64.
    pub length: u64,
}

impl Request {
    #[inline]
    pub fn new(command: Command, flags: u16, cookie: u64, offset: u64, length: u64) -> Self {
        Request { flags, command, cookie, offset, length }
    }

    /// Decodes a compact header. Only a wrong magic is an error: everything
    /// else is a request the server answers, whatever its values.
    pub fn decode(b: &[u8; REQUEST_LEN]) -> Result<Self, ProtoError> {
        let magic = be_u32(b, 0);
        if magic != REQUEST_MAGIC {
            return Err(ProtoError::BadMagic { expected: REQUEST_MAGIC as u64, found: magic as u64 });
        }
        Ok(Request {
            flags: be_u16(b, 4),
            command: Command::from_wire(be_u16(b, 6)),
            cookie: be_u64(b, 8),
            offset: be_u64(b, 16),
            length: be_u32(b, 24) as u64,
        })
    }

    /// Decodes an extended header (after `NBD_OPT_EXTENDED_HEADERS`). As
    /// with [`Request::decode`], only a wrong magic is an error.
    #[inline]
    pub fn decode_ext(b: &[u8; EXT_REQUEST_LEN]) -> Result<Self, ProtoError> {
        let magic = be_u32(b, 0);
        if magic != EXTENDED_REQUEST_MAGIC {
            return Err(ProtoError::BadMagic { expected: EXTENDED_REQUEST_MAGIC as u64, found: magic as u64 });
        }
        let command = Command::from_wire(be_u16(b, 6));
        let flags = be_u16(b, 4);
        Ok(Request {
            // The spec's draft wanted the flag on every WRITE; qemu sends
            // WRITEs without it, and its server (like this one) takes a
            // WRITE's length as its payload either way.
            flags: if command == Command::Write { flags & !cmd_flags::PAYLOAD_LEN } else { flags },
            command,
            cookie: be_u64(b, 8),
            offset: be_u64(b, 16),
            length: be_u64(b, 24),
        })
    }

    /// Encodes a compact header (`length` cut to 32 bits).
    pub fn encode(&self) -> [u8; REQUEST_LEN] {
        let mut b = [0u8; REQUEST_LEN];
        b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&self.flags.to_be_bytes());
        b[6..8].copy_from_slice(&self.command.to_wire().to_be_bytes());
        b[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        b[16..24].copy_from_slice(&self.offset.to_be_bytes());
        b[24..28].copy_from_slice(&(self.length as u32).to_be_bytes());
        b
    }

    /// Encodes an extended header; a WRITE gets `NBD_CMD_FLAG_PAYLOAD_LEN`,
    /// as libnbd sends it.
    pub fn encode_ext(&self) -> [u8; EXT_REQUEST_LEN] {
        let mut b = [0u8; EXT_REQUEST_LEN];
        let flags = if self.command == Command::Write { self.flags | cmd_flags::PAYLOAD_LEN } else { self.flags };
        b[0..4].copy_from_slice(&EXTENDED_REQUEST_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&flags.to_be_bytes());
        b[6..8].copy_from_slice(&self.command.to_wire().to_be_bytes());
        b[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        b[16..24].copy_from_slice(&self.offset.to_be_bytes());
        b[24..32].copy_from_slice(&self.length.to_be_bytes());
        b
    }

    /// Bytes of payload that follow this header on the wire: a WRITE's
    /// length; with `extended` headers also the length of any request
    /// flagged `NBD_CMD_FLAG_PAYLOAD_LEN` (which compact headers do not know).
    #[inline]
    pub fn payload_len(&self, extended: bool) -> u64 {
        if self.command == Command::Write || (extended && self.flags & cmd_flags::PAYLOAD_LEN != 0) {
            self.length
        } else {
            0
        }
    }

    /// A data command of zero bytes: valid, and answered with success
    /// without touching the backend.
    pub fn is_no_op(&self) -> bool {
        self.length == 0
            && matches!(
                self.command,
                Command::Read | Command::Write | Command::Trim | Command::WriteZeroes | Command::Cache
            )
    }

    pub fn fua(&self) -> bool {
        self.flags & cmd_flags::FUA != 0
    }

    /// Checks the request against the export, returning the errno to answer
    /// with when it cannot be served. The checks follow the spec's order of
    /// concerns: unknown command, flags (`NBD_CMD_FLAG_PAYLOAD_LEN`, a
    /// payload where none belongs, among them), permission, size limit, range.
    /// Zero-length requests inside the export are valid (see
    /// [`Request::is_no_op`]), except BLOCK_STATUS, which is EINVAL.
    /// Lengths past 32 bits (extended headers) are served for the commands
    /// without a payload; a READ or WRITE longer than `max_block` is refused.
    pub fn validate(&self, size: u64, read_only: bool, max_block: u32) -> Result<(), NbdErrno> {
        use cmd_flags::*;
        let allowed = match self.command {
            Command::Read => DF,
            Command::Write => FUA,
            Command::WriteZeroes => FUA | NO_HOLE | FAST_ZERO,
            Command::Trim => FUA,
            Command::BlockStatus => REQ_ONE,
            Command::Flush | Command::Cache | Command::Disc => 0,
            Command::Unknown(_) => return Err(NbdErrno::Inval),
        };
        if self.flags & !allowed != 0 {
            return Err(NbdErrno::Inval);
        }
        let writes = matches!(self.command, Command::Write | Command::WriteZeroes | Command::Trim);
        if writes && read_only {
            return Err(NbdErrno::Perm);
        }
        if matches!(self.command, Command::Read | Command::Write) && self.length > max_block as u64 {
            return Err(if self.command == Command::Read { NbdErrno::Overflow } else { NbdErrno::Inval });
        }
        if matches!(self.command, Command::Flush | Command::Disc) {
            return Ok(());
        }
        let end = self.offset.checked_add(self.length);
        match end {
            // A BLOCK_STATUS reply must describe at least one extent, and a
            // zero-length range has none: refused, as the spec allows.
            Some(end) if end <= size && self.command == Command::BlockStatus && self.length == 0 => {
                Err(NbdErrno::Inval)
            }
            Some(end) if end <= size => Ok(()),
            _ if matches!(self.command, Command::Write | Command::WriteZeroes) => Err(NbdErrno::NoSpc),
            _ => Err(NbdErrno::Inval),
        }
    }

    /// Refuses (`EINVAL`) a request that the export's transmission flags
    /// `tx_flags` did not announce: FLUSH, TRIM, WRITE_ZEROES and CACHE
    /// without their `SEND_*` flag, the FUA, DF and FAST_ZERO flags
    /// without theirs, and BLOCK_STATUS without a negotiated metadata
    /// context. A client may not send those; a server that announced less
    /// than [`ExportDesc::tx_flags`](super::handshake::ExportDesc::tx_flags)
    /// (a proxy) checks this after [`Request::validate`].
    pub fn check_offered(&self, tx_flags: u16, meta_context: bool) -> Result<(), NbdErrno> {
        use crate::proto::tx_flags as tx;
        let has = |f: u16| tx_flags & f != 0;
        let command = match self.command {
            Command::Read | Command::Write | Command::Disc => true,
            Command::Flush => has(tx::SEND_FLUSH),
            Command::Trim => has(tx::SEND_TRIM),
            Command::WriteZeroes => has(tx::SEND_WRITE_ZEROES),
            Command::Cache => has(tx::SEND_CACHE),
            Command::BlockStatus => meta_context,
            Command::Unknown(_) => false,
        };
        let flag = |f: u16, needs: u16| self.flags & f == 0 || has(needs);
        if command
            && flag(cmd_flags::FUA, tx::SEND_FUA)
            && flag(cmd_flags::DF, tx::SEND_DF)
            && flag(cmd_flags::FAST_ZERO, tx::SEND_FAST_ZERO)
        {
            Ok(())
        } else {
            Err(NbdErrno::Inval)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn req(command: Command, flags: u16, offset: u64, length: u64) -> Request {
        Request::new(command, flags, 7, offset, length)
    }

    #[test]
    fn out_of_range_read_is_einval_and_write_is_enospc() {
        assert_eq!(req(Command::Read, 0, 4096, 1).validate(4096, false, 1 << 25), Err(NbdErrno::Inval));
        assert_eq!(req(Command::Write, 0, 4095, 2).validate(4096, false, 1 << 25), Err(NbdErrno::NoSpc));
        assert_eq!(req(Command::WriteZeroes, 0, 0, 8192).validate(4096, false, 1 << 25), Err(NbdErrno::NoSpc));
        assert_eq!(req(Command::Trim, 0, u64::MAX, 2).validate(4096, false, 1 << 25), Err(NbdErrno::Inval));
        assert_eq!(req(Command::BlockStatus, 0, 0, 4097).validate(4096, false, 1 << 25), Err(NbdErrno::Inval));
        assert_eq!(req(Command::Read, 0, 0, 4096).validate(4096, false, 1 << 25), Ok(()));
    }

    #[test]
    fn writes_to_read_only_exports_are_eperm() {
        for c in [Command::Write, Command::Trim, Command::WriteZeroes] {
            assert_eq!(req(c, 0, 0, 1).validate(4096, true, 1 << 25), Err(NbdErrno::Perm));
        }
        assert_eq!(req(Command::Read, 0, 0, 1).validate(4096, true, 1 << 25), Ok(()));
    }

    #[test]
    fn oversized_and_unknown_requests_are_rejected() {
        assert_eq!(req(Command::Read, 0, 0, 65536).validate(1 << 30, false, 4096), Err(NbdErrno::Overflow));
        assert_eq!(req(Command::Write, 0, 0, 65536).validate(1 << 30, false, 4096), Err(NbdErrno::Inval));
        assert_eq!(req(Command::Unknown(42), 0, 0, 0).validate(4096, false, 4096), Err(NbdErrno::Inval));
        assert_eq!(req(Command::Read, cmd_flags::FUA, 0, 1).validate(4096, false, 4096), Err(NbdErrno::Inval));
    }

    #[test]
    fn zero_length_requests_are_served_as_no_ops_except_block_status() {
        let size = 1 << 20;
        for c in [Command::Read, Command::Write, Command::Trim, Command::WriteZeroes, Command::Cache] {
            let r = req(c, 0, 4096, 0);
            assert_eq!(r.validate(size, false, 1 << 25), Ok(()), "{c:?}");
            assert!(r.is_no_op(), "{c:?} of 0 bytes touches nothing");
            // At the very end of the export too; past it is still out of range.
            assert_eq!(req(c, 0, size, 0).validate(size, false, 1 << 25), Ok(()), "{c:?}");
            assert!(req(c, 0, size + 1, 0).validate(size, false, 1 << 25).is_err(), "{c:?}");
        }
        // A BLOCK_STATUS reply must describe at least one extent, which a
        // zero-length range has not: the spec lets the server refuse it.
        assert_eq!(req(Command::BlockStatus, 0, 0, 0).validate(size, false, 1 << 25), Err(NbdErrno::Inval));
        assert!(!req(Command::Flush, 0, 0, 0).is_no_op(), "a FLUSH has no length and is never skipped");
        assert!(!req(Command::Read, 0, 0, 1).is_no_op());
    }

    #[test]
    fn extended_lengths_past_32_bits_are_served_without_payload_and_refused_with_one() {
        let size = 16u64 << 30;
        let big = 5u64 << 30;
        for c in [Command::Trim, Command::WriteZeroes, Command::Cache, Command::BlockStatus] {
            assert_eq!(req(c, 0, 0, big).validate(size, false, 1 << 25), Ok(()), "{c:?}");
            // Past the end is still out of range, however long.
            assert!(req(c, 0, 0, u64::MAX).validate(size, false, 1 << 25).is_err(), "{c:?}");
        }
        assert_eq!(req(Command::Read, 0, 0, big).validate(size, false, 1 << 25), Err(NbdErrno::Overflow));
        assert_eq!(req(Command::Write, 0, 0, big).validate(size, false, 1 << 25), Err(NbdErrno::Inval));
    }

    #[test]
    fn a_payload_where_none_belongs_is_einval_and_a_write_has_one_with_or_without_the_flag() {
        // Extended headers: a WRITE's length is its payload, flagged (libnbd)
        // or not (qemu); any other command's payload is refused.
        let w = Request::decode_ext(&req(Command::Write, 0, 0, 512).encode_ext()).expect("decodes");
        assert_eq!((w.payload_len(true), w.flags, w.validate(4096, false, 4096)), (512, 0, Ok(())));
        let mut bare = req(Command::Write, cmd_flags::FUA, 0, 512).encode_ext();
        bare[4..6].copy_from_slice(&cmd_flags::FUA.to_be_bytes());
        let w = Request::decode_ext(&bare).expect("decodes");
        assert_eq!((w.payload_len(true), w.fua()), (512, true), "qemu's unflagged WRITE");
        assert_eq!(w.validate(4096, false, 4096), Ok(()));
        let r = req(Command::Read, cmd_flags::PAYLOAD_LEN, 0, 512);
        let d = Request::decode_ext(&r.encode_ext()).expect("decodes");
        assert_eq!(d.payload_len(true), 512, "the payload is still consumed");
        assert_eq!(d.validate(4096, false, 4096), Err(NbdErrno::Inval));
        // Compact headers: PAYLOAD_LEN is not a flag there, and frames nothing.
        let c = Request::decode(&req(Command::Read, cmd_flags::PAYLOAD_LEN, 0, 512).encode()).expect("decodes");
        assert_eq!((c.payload_len(false), c.validate(4096, false, 4096)), (0, Err(NbdErrno::Inval)));
        let c = Request::decode(&req(Command::Write, cmd_flags::PAYLOAD_LEN, 0, 512).encode()).expect("decodes");
        assert_eq!((c.payload_len(false), c.validate(4096, false, 4096)), (512, Err(NbdErrno::Inval)));
    }

    #[test]
    fn a_compact_header_is_refused_in_extended_mode_and_back() {
        let r = req(Command::Read, 0, 0, 512);
        let mut ext = [0u8; EXT_REQUEST_LEN];
        ext[..REQUEST_LEN].copy_from_slice(&r.encode());
        assert!(matches!(Request::decode_ext(&ext), Err(ProtoError::BadMagic { .. })));
        let e = r.encode_ext();
        let compact: &[u8; REQUEST_LEN] = e[..REQUEST_LEN].try_into().expect("decodes");
        assert!(matches!(Request::decode(compact), Err(ProtoError::BadMagic { .. })));
    }

    #[test]
    fn a_request_the_export_did_not_announce_is_einval() {
        use crate::proto::tx_flags as tx;
        let basic = tx::HAS_FLAGS | tx::SEND_FLUSH | tx::SEND_FUA;
        assert_eq!(req(Command::Read, 0, 0, 1).check_offered(basic, false), Ok(()));
        assert_eq!(req(Command::Write, cmd_flags::FUA, 0, 1).check_offered(basic, false), Ok(()));
        assert_eq!(req(Command::Write, cmd_flags::FUA, 0, 1).check_offered(tx::HAS_FLAGS, false), Err(NbdErrno::Inval));
        assert_eq!(req(Command::Flush, 0, 0, 0).check_offered(basic, false), Ok(()));
        assert_eq!(req(Command::Flush, 0, 0, 0).check_offered(tx::HAS_FLAGS, false), Err(NbdErrno::Inval));
        for (c, needs) in [
            (Command::Trim, tx::SEND_TRIM),
            (Command::WriteZeroes, tx::SEND_WRITE_ZEROES),
            (Command::Cache, tx::SEND_CACHE),
        ] {
            assert_eq!(req(c, 0, 0, 1).check_offered(basic, false), Err(NbdErrno::Inval), "{c:?}");
            assert_eq!(req(c, 0, 0, 1).check_offered(basic | needs, false), Ok(()), "{c:?}");
        }
        assert_eq!(req(Command::Read, cmd_flags::DF, 0, 1).check_offered(basic, false), Err(NbdErrno::Inval));
        assert_eq!(req(Command::Read, cmd_flags::DF, 0, 1).check_offered(basic | tx::SEND_DF, false), Ok(()));
        let zeroes = basic | tx::SEND_WRITE_ZEROES;
        let fast = req(Command::WriteZeroes, cmd_flags::FAST_ZERO, 0, 1);
        assert_eq!(fast.check_offered(zeroes, false), Err(NbdErrno::Inval));
        assert_eq!(fast.check_offered(zeroes | tx::SEND_FAST_ZERO, false), Ok(()));
        assert_eq!(req(Command::BlockStatus, 0, 0, 1).check_offered(u16::MAX, false), Err(NbdErrno::Inval));
        assert_eq!(req(Command::BlockStatus, 0, 0, 1).check_offered(basic, true), Ok(()));
        assert_eq!(req(Command::Unknown(99), 0, 0, 1).check_offered(u16::MAX, true), Err(NbdErrno::Inval));
    }

    proptest! {
        /// Everything announced: nothing a valid request asks is refused.
        #[test]
        fn with_every_flag_announced_a_valid_request_is_offered(flags: u16, c in 0u16..8, offset in 0u64..8192, length in 1u64..4096) {
            let r = Request::new(Command::from_wire(c), flags, 1, offset, length);
            if r.validate(1 << 20, false, 1 << 25).is_ok() {
                prop_assert_eq!(r.check_offered(u16::MAX, true), Ok(()));
            }
        }

        #[test]
        fn request_roundtrips(flags: u16, c: u16, cookie: u64, offset: u64, length: u32) {
            let r = Request::new(Command::from_wire(c), flags, cookie, offset, length as u64);
            prop_assert_eq!(Request::decode(&r.encode()).unwrap(), r);
        }

        #[test]
        fn extended_request_roundtrips(flags: u16, c: u16, cookie: u64, offset: u64, length: u64) {
            let command = Command::from_wire(c);
            let flags = if command == Command::Write { flags & !cmd_flags::PAYLOAD_LEN } else { flags };
            let r = Request::new(command, flags, cookie, offset, length);
            let b = r.encode_ext();
            prop_assert_eq!(Request::decode_ext(&b).expect("decodes"), r);
            prop_assert_eq!(be_u64(&b, 24), length);
        }

        #[test]
        fn any_header_decodes_or_errors(bytes in prop::array::uniform28(any::<u8>())) {
            if let Ok(r) = Request::decode(&bytes) {
                let _ = r.validate(1 << 30, false, 1 << 25);
                prop_assert_eq!(r.encode(), bytes);
            }
        }

        #[test]
        fn any_extended_header_decodes_or_errors(bytes in prop::array::uniform32(any::<u8>())) {
            if let Ok(r) = Request::decode_ext(&bytes) {
                let _ = r.validate(1 << 40, false, 1 << 25);
                let mut again = r.encode_ext();
                if r.command == Command::Write {
                    // An unflagged WRITE comes back flagged; nothing else changes.
                    again[5] = (again[5] & !(cmd_flags::PAYLOAD_LEN as u8)) | (bytes[5] & cmd_flags::PAYLOAD_LEN as u8);
                }
                prop_assert_eq!(again, bytes);
            }
        }
    }
}
