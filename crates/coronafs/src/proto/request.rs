//! Transmission-phase requests: the 28-byte header and the checks that need
//! nothing but the header and the export's geometry.

use super::*;

/// Size of a request header.
pub const REQUEST_LEN: usize = 28;

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

/// A decoded request header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub flags: u16,
    pub command: Command,
    pub cookie: u64,
    pub offset: u64,
    pub length: u32,
}

impl Request {
    /// Decodes a header. Only a wrong magic is an error: everything else is a
    /// request the server answers, whatever its values.
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
            length: be_u32(b, 24),
        })
    }

    pub fn encode(&self) -> [u8; REQUEST_LEN] {
        let mut b = [0u8; REQUEST_LEN];
        b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&self.flags.to_be_bytes());
        b[6..8].copy_from_slice(&self.command.to_wire().to_be_bytes());
        b[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        b[16..24].copy_from_slice(&self.offset.to_be_bytes());
        b[24..28].copy_from_slice(&self.length.to_be_bytes());
        b
    }

    /// Bytes of payload that follow this header on the wire.
    pub fn payload_len(&self) -> u32 {
        if self.command == Command::Write { self.length } else { 0 }
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
    /// concerns: unknown command, flags, permission, size limit, range.
    /// Zero-length requests inside the export are valid (see
    /// [`Request::is_no_op`]), except BLOCK_STATUS, which is EINVAL.
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
        if matches!(self.command, Command::Read | Command::Write) && self.length > max_block {
            return Err(if self.command == Command::Read { NbdErrno::Overflow } else { NbdErrno::Inval });
        }
        if matches!(self.command, Command::Flush | Command::Disc) {
            return Ok(());
        }
        let end = self.offset.checked_add(self.length as u64);
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn req(command: Command, flags: u16, offset: u64, length: u32) -> Request {
        Request { flags, command, cookie: 7, offset, length }
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

    proptest! {
        #[test]
        fn request_roundtrips(flags: u16, c: u16, cookie: u64, offset: u64, length: u32) {
            let r = Request { flags, command: Command::from_wire(c), cookie, offset, length };
            prop_assert_eq!(Request::decode(&r.encode()).unwrap(), r);
        }

        #[test]
        fn any_header_decodes_or_errors(bytes in prop::array::uniform28(any::<u8>())) {
            if let Ok(r) = Request::decode(&bytes) {
                let _ = r.validate(1 << 30, false, 1 << 25);
                prop_assert_eq!(r.encode(), bytes);
            }
        }
    }
}
